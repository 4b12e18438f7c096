//! One seed's run: a cluster under a workload and a schedule of faults, then healing,
//! then the checkers.

use crate::check;
use crate::cluster::{Cluster, VOLUME};
use crate::ledger::Ledger;
use crate::network::{Faults, Network};
use crate::workload::{worker, Device, GROUP_BLOCKS};
use floe_protocol::connection::CallError;
use floe_protocol::{
    MasterRequest, MasterResponse, PlacementMode, VolumeMode, VolumeSpec, WriteMode,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How long the workload runs under faults (virtual time).
const WORKLOAD_TIME: Duration = Duration::from_secs(20);
const WORKERS_PER_GATEWAY: u64 = 3;
const HOSTS: usize = 4;
/// How long a gateway may take to open the volume (another holder's lease must run
/// out first).
const OPEN_TIME_MAX: Duration = Duration::from_secs(90);
/// Answers of the master's status, half a second apart, that must all leave out a
/// dead server before the operator takes it for one that never registered (a
/// registration still on its way lands well within them).
const UNLISTED_ANSWERS: u32 = 10;

/// What a seed did.
#[derive(Default)]
pub struct Report {
    pub writes_acked: usize,
    pub reads_checked: u64,
    /// Blocks of snapshots read at the end and checked.
    pub snapshot_reads: u64,
    /// Stale reads checked.
    pub stale_reads: u64,
    /// FLUSHes that succeeded (write-back).
    pub flushes: u64,
    pub events: Vec<String>,
    /// (fingerprint, messages): equal for two runs of one seed.
    pub trace: (u64, u64),
    /// Every message leg (see [`Network::trace`]).
    pub legs: Vec<(u64, usize, usize, u64)>,
    pub virtual_time: Duration,
}

/// Something to do later in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Later {
    RestartServer(usize),
    RestartMaster,
    Heal,
    FreeSpace(usize),
}

struct Workers {
    /// The gateway they run on; `None`: the stale reader, which no gateway's failure stops.
    gateway: Option<usize>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

struct Run {
    rng: StdRng,
    /// Draws whether a write-back seed's power cut takes every host, apart from
    /// `rng` so that every other draw stays what it was before such cuts existed.
    power_rng: StdRng,
    /// Draws when snapshots are taken (write-through seeds), apart from `rng` too.
    snapshot_rng: StdRng,
    /// Snapshots taken so far.
    snapshots: u32,
    /// Draws whether a stale reader runs, and its bound (write-through seeds), apart
    /// from `rng` too.
    stale_rng: StdRng,
    /// Whether a master kill waits for the master's next view change.
    view_rng: StdRng,
    /// A master death at its next view change is armed.
    view_death: bool,
    seed: u64,
    cluster: Cluster,
    network: Arc<Network>,
    ledger: Ledger,
    groups: Vec<u64>,
    workers: Vec<Workers>,
    /// The gateway that last opened the volume for writing.
    writer: usize,
    later: BTreeMap<(Duration, u64), Later>,
    later_count: u64,
    events: Vec<String>,
    lost_one: bool,
    expanded: bool,
    write_mode: WriteMode,
    /// Volumes opened for writing so far (each device's id).
    opened: u64,
    violations: Vec<String>,
}

/// The volume's write mode for `seed`: write-back for one seed in three (from the
/// seed itself, so the others run exactly as before write-back was simulated).
pub fn write_mode_of(seed: u64) -> WriteMode {
    if seed % 3 == 2 {
        WriteMode::WriteBack
    } else {
        WriteMode::WriteThrough
    }
}

pub async fn run(seed: u64, write_mode: WriteMode) -> Result<Report, (Vec<String>, Report)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let faults = Faults {
        delay_max: Duration::from_micros(rng.gen_range(50..3_000)),
        spike_per_million: rng.gen_range(0..20_000),
        spike_max: Duration::from_millis(rng.gen_range(1..500)),
        drop_per_million: rng.gen_range(0..10_000),
        duplicate_per_million: rng.gen_range(0..20_000),
    };
    let network = Network::new(seed, faults);
    let placement = if rng.gen_bool(0.5) {
        PlacementMode::Mapx
    } else {
        PlacementMode::Crush
    };
    let settings = floe_master::Settings {
        placement,
        ..Default::default()
    };
    let mut cluster = Cluster::new(network.clone(), settings);
    for host in 0..HOSTS {
        for _ in 0..rng.gen_range(1..=2) {
            cluster.add_server(&format!("h{host}"));
        }
    }
    cluster.add_gateway();
    cluster.add_gateway();
    let mut run = Run {
        rng,
        power_rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
        snapshot_rng: StdRng::seed_from_u64(seed ^ 0x5a5a_1234_c3c3_8765),
        snapshots: 0,
        stale_rng: StdRng::seed_from_u64(seed ^ 0x3c3c_5a5a_0f0f_a5a5),
        view_rng: StdRng::seed_from_u64(seed ^ 0x0f1e_2d3c_4b5a_6978),
        view_death: false,
        seed,
        cluster,
        network: network.clone(),
        ledger: Ledger::default(),
        groups: Vec::new(),
        workers: Vec::new(),
        writer: 0,
        later: BTreeMap::new(),
        later_count: 0,
        events: vec![format!(
            "{} servers on {HOSTS} hosts, {placement:?} placement, {faults:?}",
            0
        )],
        lost_one: false,
        expanded: false,
        write_mode,
        opened: 0,
        violations: Vec::new(),
    };
    run.events[0] = run.events[0].replacen(
        "0 servers",
        &format!("{} servers", run.cluster.servers.len()),
        1,
    );
    if write_mode != WriteMode::WriteThrough {
        run.events[0] += &format!(", {write_mode:?} volume");
    }
    if let Err(e) = run.main().await {
        run.violations.push(e);
    }
    run.violations.extend(network.observations.violations());
    run.violations.extend(run.ledger.violations());
    network.shut_down();
    let report = Report {
        writes_acked: run.ledger.writes_acked(),
        reads_checked: run.ledger.reads_checked(),
        snapshot_reads: run.ledger.snapshot_reads(),
        stale_reads: run.ledger.stale_reads(),
        flushes: run.ledger.flushes(),
        events: run.events,
        trace: network.trace_hash(),
        legs: network.trace(),
        virtual_time: network.now(),
    };
    if run.violations.is_empty() {
        Ok(report)
    } else {
        Err((run.violations, report))
    }
}

impl Run {
    fn event(&mut self, what: String) {
        let at = self.network.now();
        self.events
            .push(format!("{:>9.3}s {what}", at.as_secs_f64()));
    }

    fn schedule(&mut self, after: Duration, what: Later) {
        self.later_count += 1;
        self.later
            .insert((self.network.now() + after, self.later_count), what);
    }

    async fn main(&mut self) -> Result<(), String> {
        self.cluster.start_master().await?;
        for n in 0..self.cluster.servers.len() {
            self.cluster.start_server(n).await?;
        }
        let servers = self.cluster.servers.len();
        check::until(
            Duration::from_secs(30),
            "every server registered",
            || async {
                let status = self.cluster.admin().status().await.ok()?;
                (status.servers.iter().filter(|s| s.up).count() == servers).then_some(())
            },
        )
        .await?;
        let spec = VolumeSpec {
            name: VOLUME.into(),
            size_bytes: 4 << 20,
            replicas: 3,
            chunk_bytes: 1 << 20,
            stripe_unit_bytes: 64 << 10,
            stripe_count: 2,
            mode: VolumeMode::Ssd,
            write_mode: self.write_mode,
        };
        self.admin_call(MasterRequest::CreateVolume(spec), "create the volume")
            .await?;
        let mut groups: Vec<u64> = (0..(4 << 20) / 4096 / GROUP_BLOCKS).collect();
        groups.shuffle(&mut self.rng);
        groups.truncate(12);
        self.groups = groups.iter().map(|g| g * GROUP_BLOCKS).collect();
        self.ledger.add_blocks(
            self.groups
                .iter()
                .flat_map(|&g| g..g + GROUP_BLOCKS)
                .collect::<Vec<_>>(),
        );
        self.take_over(0).await?;
        self.maybe_stale_reader();

        while self.network.now() < WORKLOAD_TIME {
            let pause = Duration::from_millis(self.rng.gen_range(200..2_500));
            self.run_for(pause).await;
            self.fault().await?;
            self.maybe_snapshot();
        }
        self.stop_workers().await;
        self.heal().await?;
        check::settled(&self.cluster).await?;
        self.violations
            .extend(check::final_state(&self.cluster, &self.ledger).await);
        self.violations
            .extend(check::snapshots(&self.cluster, &self.ledger).await);
        self.violations.extend(check::split_brain(
            &self.network.observations.grants(),
            &self.ledger.acks(),
        ));
        Ok(())
    }

    /// Lets time pass, doing what was scheduled.
    async fn run_for(&mut self, time: Duration) {
        let until = self.network.now() + time;
        loop {
            let next = self.later.keys().next().copied();
            match next {
                Some(key) if key.0 <= until => {
                    tokio::time::sleep(key.0.saturating_sub(self.network.now())).await;
                    let what = self.later.remove(&key).expect("scheduled");
                    self.do_later(what).await;
                }
                _ => {
                    tokio::time::sleep(until.saturating_sub(self.network.now())).await;
                    return;
                }
            }
        }
    }

    async fn do_later(&mut self, what: Later) {
        match what {
            Later::RestartServer(n) => {
                if !self.network.alive(self.cluster.servers[n].process)
                    && !self.cluster.servers[n].lost
                {
                    self.event(format!("restart cs{n}"));
                    if let Err(e) = self.cluster.start_server(n).await {
                        self.violations.push(e);
                    }
                }
            }
            Later::RestartMaster => {
                if std::mem::take(&mut self.view_death) {
                    let armed = &self.cluster.master_dies_storing_a_view;
                    self.event(match armed.swap(false, Ordering::SeqCst) {
                        true => "the master stored no view change meanwhile".into(),
                        false => "the master died storing a view change".into(),
                    });
                }
                if !self.network.alive(self.cluster.master) {
                    self.event("restart master".into());
                    if let Err(e) = self.cluster.start_master().await {
                        self.violations.push(e);
                    }
                }
            }
            Later::Heal => {
                self.event("heal the network".into());
                self.network.heal();
            }
            Later::FreeSpace(n) => {
                self.event(format!("space freed on cs{n}"));
                self.cluster.free_disk(n);
            }
        }
    }

    /// Now and then (write-through volumes: the ledger's snapshot rule assumes every
    /// acknowledged write durable), snapshots the volume while the workload and the
    /// faults go on; the creation runs as a task of its own.
    fn maybe_snapshot(&mut self) {
        if self.write_mode != WriteMode::WriteThrough || !self.snapshot_rng.gen_ratio(1, 5) {
            return;
        }
        self.snapshots += 1;
        let name = format!("s{}", self.snapshots);
        self.event(format!("snapshot {VOLUME}@{name}"));
        self.ledger.begin_snapshot(&name);
        let (admin, ledger) = (self.cluster.admin().clone(), self.ledger.clone());
        tokio::spawn(async move {
            let request = MasterRequest::CreateSnapshot {
                name: VOLUME.into(),
                snapshot: name.clone(),
            };
            // Failed or unanswered: the snapshot may exist, and takes every write
            // begun since (the check is weaker, never wrong).
            if let Ok(MasterResponse::Snapshot(_)) = admin.call(request).await {
                ledger.snapshot_taken(&name);
            }
        });
        self.maybe_delete_snapshot();
    }

    /// After one snapshot in three, deletes an earlier one (any, not only the oldest):
    /// the master then frees in the background the delta chunks no snapshot reads,
    /// and every snapshot left must still read as it was. A deleted snapshot is not
    /// checked (one whose deletion failed is).
    fn maybe_delete_snapshot(&mut self) {
        if self.snapshots < 2 || !self.snapshot_rng.gen_ratio(1, 3) {
            return;
        }
        let name = format!("s{}", self.snapshot_rng.gen_range(1..self.snapshots));
        self.event(format!("delete snapshot {VOLUME}@{name}"));
        let admin = self.cluster.admin().clone();
        tokio::spawn(async move {
            let request = MasterRequest::DeleteSnapshot {
                name: VOLUME.into(),
                snapshot: name,
            };
            let _ = admin.call(request).await;
        });
    }

    /// On half the write-through seeds (the ledger's bound assumes every
    /// acknowledged write durable), a stale reader with a bound of 0.2-3 s reads
    /// beside the writers.
    fn maybe_stale_reader(&mut self) {
        if self.write_mode != WriteMode::WriteThrough || !self.stale_rng.gen_bool(0.5) {
            return;
        }
        let staleness = Duration::from_millis(self.stale_rng.gen_range(200..3_000));
        self.event(format!("a stale reader attaches (bound {staleness:?})"));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(crate::stale_reader::read(
            self.stale_rng.gen(),
            staleness,
            self.ledger.clone(),
            self.network.clone(),
            self.groups.clone(),
            stop.clone(),
        ));
        // Stopped with the writers.
        self.workers.push(Workers {
            gateway: None,
            stop,
            tasks: vec![task],
        });
    }

    fn live_servers(&self) -> Vec<usize> {
        (0..self.cluster.servers.len())
            .filter(|&n| self.network.alive(self.cluster.servers[n].process))
            .collect()
    }

    async fn fault(&mut self) -> Result<(), String> {
        let restart_after = Duration::from_millis(self.rng.gen_range(200..8_000));
        match self.rng.gen_range(0..110) {
            100..=109 => {
                let live = self.live_servers();
                if let Some(&n) = live.choose(&mut self.rng) {
                    // Full at once, or after a few writes.
                    let writable = self.rng.gen_range(0..8 << 20);
                    self.event(format!(
                        "the disk of cs{n} fills ({writable} bytes writable left)"
                    ));
                    self.cluster.fill_disk(n, writable);
                    let free_after = Duration::from_millis(self.rng.gen_range(500..10_000));
                    self.schedule(free_after, Later::FreeSpace(n));
                }
            }
            0..=24 => {
                let live = self.live_servers();
                if let Some(&n) = live.choose(&mut self.rng) {
                    self.event(format!("kill -9 cs{n}"));
                    self.cluster.kill_server(n);
                    self.schedule(restart_after, Later::RestartServer(n));
                }
            }
            25..=29 => {
                let host = format!("h{}", self.rng.gen_range(0..HOSTS));
                self.event(format!("kill -9 every server on {host}"));
                for n in self.live_servers() {
                    if self.cluster.servers[n].host == host {
                        self.cluster.kill_server(n);
                        self.schedule(restart_after, Later::RestartServer(n));
                    }
                }
            }
            30..=34 => {
                let mut host = format!("h{}", self.rng.gen_range(0..HOSTS));
                // Write-back promises more after a power cut of every server: what a
                // completed FLUSH covered survives. Half its power cuts cut every host.
                let everywhere =
                    self.write_mode == WriteMode::WriteBack && self.power_rng.gen_bool(0.5);
                if everywhere {
                    host = "every host".into();
                }
                let on_host: Vec<usize> = self
                    .live_servers()
                    .into_iter()
                    .filter(|&n| everywhere || self.cluster.servers[n].host == host)
                    .collect();
                // The power fails a few disk changes in: wherever the servers are in
                // their work, then the machine stops.
                for &n in &on_host {
                    let changes = self.rng.gen_range(0..16);
                    self.cluster.power_failing(n, changes);
                }
                let failing = Duration::from_millis(self.rng.gen_range(0..20));
                self.run_for(failing).await;
                self.event(format!("power cut of {host}"));
                self.ledger.power_cut();
                for &n in &on_host {
                    let seed = self.rng.gen();
                    self.cluster.power_cut(n, seed);
                    self.schedule(restart_after, Later::RestartServer(n));
                }
            }
            35..=54 => {
                if self.network.is_cut() {
                    return Ok(());
                }
                let mut everyone = vec![self.cluster.master];
                everyone.extend(self.cluster.servers.iter().map(|s| s.process));
                everyone.extend(self.cluster.gateways.iter().map(|g| g.process));
                everyone.shuffle(&mut self.rng);
                let size = self.rng.gen_range(1..=2);
                let (side, rest) = everyone.split_at(size);
                let names: Vec<String> = side.iter().map(|&p| self.network.name(p)).collect();
                self.event(format!("partition {names:?} from the rest"));
                self.network.cut(side, rest);
                let heal_after = Duration::from_millis(self.rng.gen_range(500..10_000));
                self.schedule(heal_after, Later::Heal);
            }
            55..=64 => {
                if self.network.alive(self.cluster.master) && self.view_rng.gen_bool(0.5) {
                    // Between moving a chunk's replicas to a new view and storing it:
                    // the orphan view a leader that lost etcd leaves behind.
                    self.event("the master will die as it stores its next view change".into());
                    self.view_death = true;
                    self.cluster
                        .master_dies_storing_a_view
                        .store(true, Ordering::SeqCst);
                    self.schedule(
                        restart_after.min(Duration::from_secs(5)),
                        Later::RestartMaster,
                    );
                } else if self.network.alive(self.cluster.master) {
                    self.event("kill -9 master".into());
                    self.cluster.kill_master();
                    self.schedule(
                        restart_after.min(Duration::from_secs(5)),
                        Later::RestartMaster,
                    );
                }
            }
            65..=79 => {
                if self.network.is_cut() {
                    return Ok(());
                }
                let old = self.writer;
                self.event(format!(
                    "cut gw{old} off from the master alone; gw{} takes over",
                    1 - old
                ));
                self.network.cut(
                    &[self.cluster.gateways[old].process],
                    &[self.cluster.master],
                );
                let heal_after = Duration::from_millis(self.rng.gen_range(1_000..10_000));
                self.schedule(heal_after, Later::Heal);
                self.take_over(1 - old).await?;
            }
            80..=89 => {
                let old = self.writer;
                self.event(format!("kill -9 gw{old}; gw{} takes over", 1 - old));
                self.stop_gateway(old);
                self.cluster.kill_gateway(old);
                self.take_over(1 - old).await?;
            }
            90..=94 => {
                let live = self.live_servers();
                let hosts_left = {
                    let mut hosts: Vec<&str> = live
                        .iter()
                        .map(|&n| self.cluster.servers[n].host.as_str())
                        .collect();
                    hosts.sort_unstable();
                    hosts.dedup();
                    hosts.len()
                };
                if self.lost_one || hosts_left < HOSTS {
                    return Ok(());
                }
                let n = *live.choose(&mut self.rng).expect("live servers");
                self.lost_one = true;
                self.event(format!("cs{n} dies for good; the operator marks it lost"));
                self.cluster.kill_server(n);
                self.cluster.servers[n].lost = true;
                self.mark_lost(n).await?;
            }
            _ => {
                if self.expanded {
                    return Ok(());
                }
                self.expanded = true;
                let n = self.cluster.add_server(&format!("h{HOSTS}"));
                self.event(format!(
                    "cs{n} joins on a new host; the operator expands the map"
                ));
                self.cluster.start_server(n).await?;
                self.admin_call(MasterRequest::ExpandCluster { hosts: Vec::new() }, "expand")
                    .await?;
            }
        }
        Ok(())
    }

    /// An operator's command: retried (with scheduled work going on) until the master
    /// takes it, as an operator would; a refusal saying it is done already (the reply
    /// to an earlier try was lost) counts as done.
    async fn admin_call(&mut self, request: MasterRequest, what: &str) -> Result<(), String> {
        let give_up = self.network.now() + OPEN_TIME_MAX;
        loop {
            let reply = tokio::time::timeout(
                Duration::from_secs(5),
                self.cluster.admin().call(request.clone()),
            )
            .await;
            match reply {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(CallError::Remote { message, .. })) if message.contains("already") => {
                    return Ok(())
                }
                _ if self.network.now() > give_up => {
                    return Err(format!("{what}: the master never took it: {reply:?}"))
                }
                _ => self.run_for(Duration::from_millis(500)).await,
            }
        }
    }

    /// Marks dead server `n` lost, once the master lists it. A server that died
    /// before it ever registered (it joined while the master was down) is unknown to
    /// the master: no map places anything there, and there is nothing to mark.
    async fn mark_lost(&mut self, n: usize) -> Result<(), String> {
        let address = self.cluster.servers[n].address.clone();
        let give_up = self.network.now() + OPEN_TIME_MAX;
        let mut unlisted = 0;
        let id = loop {
            if let Ok(Ok(status)) =
                tokio::time::timeout(Duration::from_secs(5), self.cluster.admin().status()).await
            {
                match status.servers.iter().find(|s| s.address == address) {
                    Some(s) => break s.id,
                    None => unlisted += 1,
                }
            }
            // Registrations persist: a master answering without it several heartbeats
            // after the death never heard of it.
            if unlisted >= UNLISTED_ANSWERS {
                self.event(format!("cs{n} never registered: nothing to mark lost"));
                return Ok(());
            }
            if self.network.now() > give_up {
                return Err(format!("cs{n} never showed in the master's status"));
            }
            self.run_for(Duration::from_millis(500)).await;
        };
        self.admin_call(MasterRequest::MarkLost { id }, "mark lost")
            .await
    }

    /// Gateway `n` opens the volume for writing and its workers start. It may be
    /// refused while the previous writer still renews its lease: when the cut that
    /// was to depose it healed before the lease ran out.
    async fn take_over(&mut self, n: usize) -> Result<(), String> {
        self.stop_gateway(n);
        let previous = self.writer;
        let give_up = self.network.now() + OPEN_TIME_MAX;
        let device = loop {
            if !self.network.alive(self.cluster.master) {
                self.do_later(Later::RestartMaster).await;
            }
            let opened =
                tokio::time::timeout(Duration::from_secs(20), self.cluster.open_volume(n)).await;
            match opened {
                Ok(Ok(device)) => break device,
                Ok(Err(e))
                    if e.contains("in use")
                        && previous != n
                        && self.network.alive(self.cluster.gateways[previous].process)
                        && !self.network.is_cut() =>
                {
                    self.event(format!("gw{n} refused: gw{previous} renewed its lease"));
                    self.cluster.kill_gateway(n);
                    return Ok(());
                }
                _ if self.network.now() > give_up => {
                    return Err(format!(
                        "gw{n} could not open the volume within {OPEN_TIME_MAX:?}: {opened:?}",
                        opened = opened.map(|r| r.map(|_| ()))
                    ))
                }
                _ => self.run_for(Duration::from_millis(500)).await,
            }
        };
        self.event(format!("gw{n} holds the volume"));
        self.writer = n;
        self.opened += 1;
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..WORKERS_PER_GATEWAY)
            .map(|w| {
                let seed = self
                    .seed
                    .wrapping_mul(31)
                    .wrapping_add(self.rng.gen::<u64>() ^ w);
                tokio::spawn(worker(
                    seed,
                    self.cluster.gateways[n].name.clone(),
                    Device {
                        device: device.clone(),
                        id: self.opened,
                        write_back: self.write_mode == WriteMode::WriteBack,
                    },
                    self.ledger.clone(),
                    self.network.clone(),
                    self.groups.clone(),
                    stop.clone(),
                ))
            })
            .collect();
        drop(device);
        self.workers.push(Workers {
            gateway: Some(n),
            stop,
            tasks,
        });
        Ok(())
    }

    /// Stops gateway `n`'s workers at once, as if its process died.
    fn stop_gateway(&mut self, n: usize) {
        for workers in self.workers.iter().filter(|w| w.gateway == Some(n)) {
            for task in &workers.tasks {
                task.abort();
            }
        }
        self.workers.retain(|w| w.gateway != Some(n));
    }

    /// Asks every worker to finish its operation; those that cannot (their gateway is
    /// wedged) are stopped, their writes left uncertain.
    async fn stop_workers(&mut self) {
        for workers in &self.workers {
            workers.stop.store(true, Ordering::Relaxed);
        }
        let give_up = self.network.now() + Duration::from_secs(90);
        while self
            .workers
            .iter()
            .any(|w| w.tasks.iter().any(|t| !t.is_finished()))
            && self.network.now() < give_up
        {
            self.run_for(Duration::from_millis(100)).await;
        }
        for workers in std::mem::take(&mut self.workers) {
            for task in workers.tasks {
                task.abort();
            }
        }
    }

    /// The end of the faults: the network heals, every process not lost runs, and the
    /// gateways close the volume. A lease given up is not released: it must run out
    /// at the master (which then audits the volume) before the cluster can be healed.
    async fn heal(&mut self) -> Result<(), String> {
        self.event("heal everything".into());
        self.network.set_faults(Faults::CALM);
        self.network.heal();
        self.later.clear();
        self.view_death = false;
        self.cluster
            .master_dies_storing_a_view
            .store(false, Ordering::SeqCst);
        for n in 0..self.cluster.servers.len() {
            self.cluster.free_disk(n);
        }
        if !self.network.alive(self.cluster.master) {
            self.cluster.start_master().await?;
        }
        for n in 0..self.cluster.servers.len() {
            let server = &self.cluster.servers[n];
            if !server.lost && !self.network.alive(server.process) {
                self.cluster.start_server(n).await?;
            }
        }
        for gateway in &mut self.cluster.gateways {
            gateway.device = None;
        }
        let lapse = floe_master::LEASE_TERM + floe_master::LEASE_DRIFT_MARGIN;
        tokio::time::sleep(lapse + Duration::from_secs(2)).await;
        Ok(())
    }
}
