//! The simulated network: every call between simulated processes goes through
//! [`Network::call`], which delays, drops, duplicates and reorders messages, holds
//! them across partitions (TCP delivers once the path heals), and fails calls to a
//! process that crashed (its peers' connections are reset). All randomness comes from
//! the seeded generator and all time from tokio's paused clock, so a seed replays
//! exactly; [`Network::trace_hash`] proves it.

use crate::observe::Observations;
use floe_protocol::connection::CallError;
use floe_protocol::server::Handler;
use floe_protocol::transport::{CallFuture, Transport};
use floe_protocol::{Request, Response};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

/// A process's request handler, whatever the process.
pub type Service =
    Arc<dyn Fn(Request) -> Pin<Box<dyn Future<Output = Response> + Send>> + Send + Sync>;

pub fn service<H: Handler>(handler: Arc<H>) -> Service {
    Arc::new(move |request| Box::pin(handler.clone().handle(request)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessId(pub usize);

/// A seed sends some thousands of messages; this many means a retry loop that never
/// waits.
const MESSAGES_MAX: u64 = 200_000;

/// How hostile the network is; per message.
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    pub delay_max: Duration,
    /// A rare long delay (a stalled link, a GC pause): reorders far more.
    pub spike_per_million: u32,
    pub spike_max: Duration,
    /// The connection breaks: the caller sees it closed; the request may or may not
    /// have been served (reply lost).
    pub drop_per_million: u32,
    /// The request is delivered a second time, a little later.
    pub duplicate_per_million: u32,
}

impl Faults {
    pub const CALM: Faults = Faults {
        delay_max: Duration::from_micros(200),
        spike_per_million: 0,
        spike_max: Duration::ZERO,
        drop_per_million: 0,
        duplicate_per_million: 0,
    };
}

struct Process {
    name: String,
    host: String,
    address: Option<String>,
    incarnation: u64,
    alive: bool,
    service: Option<Service>,
    /// Turns true when this incarnation dies: calls it is serving fail at once.
    died: watch::Sender<bool>,
}

struct State {
    rng: StdRng,
    faults: Faults,
    processes: Vec<Process>,
    by_address: BTreeMap<String, ProcessId>,
    /// Pairs (lower id first) that cannot reach each other.
    cut: BTreeSet<(ProcessId, ProcessId)>,
    trace_hash: u64,
    messages: u64,
    /// Every message leg: (virtual µs, from, to, kind), to find where two runs of
    /// one seed part.
    trace: Vec<(u64, usize, usize, u64)>,
}

pub struct Network {
    state: Mutex<State>,
    /// Woken when a partition heals.
    healed: Notify,
    start: Instant,
    pub observations: Observations,
}

enum Leg {
    Request,
    Reply,
}

impl Network {
    pub fn new(seed: u64, faults: Faults) -> Arc<Network> {
        Arc::new(Network {
            state: Mutex::new(State {
                rng: StdRng::seed_from_u64(seed ^ 0x6e65_7477_6f72_6b00),
                faults,
                processes: Vec::new(),
                by_address: BTreeMap::new(),
                cut: BTreeSet::new(),
                trace_hash: 0xcbf2_9ce4_8422_2325,
                messages: 0,
                trace: Vec::new(),
            }),
            healed: Notify::new(),
            start: Instant::now(),
            observations: Observations::new(Instant::now()),
        })
    }

    /// Virtual time since the simulation started.
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn set_faults(&self, faults: Faults) {
        self.state.lock().unwrap().faults = faults;
    }

    /// A new process (not yet running).
    pub fn add(&self, name: &str, host: &str) -> ProcessId {
        let mut s = self.state.lock().unwrap();
        s.processes.push(Process {
            name: name.to_string(),
            host: host.to_string(),
            address: None,
            incarnation: 0,
            alive: false,
            service: None,
            died: watch::channel(true).0,
        });
        ProcessId(s.processes.len() - 1)
    }

    pub fn name(&self, id: ProcessId) -> String {
        self.state.lock().unwrap().processes[id.0].name.clone()
    }

    pub fn host(&self, id: ProcessId) -> String {
        self.state.lock().unwrap().processes[id.0].host.clone()
    }

    /// Starts a new incarnation of `id`: a transport for it to call through. Its
    /// requests are served once [`Network::serve`] names its handler.
    pub fn boot(self: &Arc<Self>, id: ProcessId) -> Arc<SimTransport> {
        let mut s = self.state.lock().unwrap();
        let p = &mut s.processes[id.0];
        assert!(!p.alive, "{} booted twice", p.name);
        p.incarnation += 1;
        p.alive = true;
        p.died = watch::channel(false).0;
        Arc::new(SimTransport {
            network: self.clone(),
            from: id,
            incarnation: p.incarnation,
        })
    }

    /// Serves requests sent to `address` with `service` (the incarnation of `from`).
    pub fn serve(&self, from: &SimTransport, address: &str, service: Service) {
        let mut s = self.state.lock().unwrap();
        let p = &mut s.processes[from.from.0];
        if !p.alive || p.incarnation != from.incarnation {
            return;
        }
        p.address = Some(address.to_string());
        p.service = Some(service);
        s.by_address.insert(address.to_string(), from.from);
    }

    /// kill -9: the process stops at once; its peers' connections are reset. Its
    /// tasks live on as zombies that can neither send nor be reached.
    pub fn kill(&self, id: ProcessId) {
        let mut s = self.state.lock().unwrap();
        let p = &mut s.processes[id.0];
        p.alive = false;
        p.service = None;
        p.died.send_replace(true);
    }

    /// Drops every process's handler: handlers hold transports that hold this
    /// network, a cycle that would keep a whole cluster (disks included) alive after
    /// its run.
    pub fn shut_down(&self) {
        let mut s = self.state.lock().unwrap();
        for p in &mut s.processes {
            p.service = None;
            p.alive = false;
        }
        s.by_address.clear();
    }

    pub fn alive(&self, id: ProcessId) -> bool {
        self.state.lock().unwrap().processes[id.0].alive
    }

    pub fn is_current(&self, id: ProcessId, incarnation: u64) -> bool {
        let s = self.state.lock().unwrap();
        let p = &s.processes[id.0];
        p.alive && p.incarnation == incarnation
    }

    /// Cuts every process in `a` off from every process in `b`.
    pub fn cut(&self, a: &[ProcessId], b: &[ProcessId]) {
        let mut s = self.state.lock().unwrap();
        for &x in a {
            for &y in b {
                if x != y {
                    s.cut.insert((x.min(y), x.max(y)));
                }
            }
        }
    }

    pub fn heal(&self) {
        self.state.lock().unwrap().cut.clear();
        self.healed.notify_waiters();
    }

    pub fn is_cut(&self) -> bool {
        !self.state.lock().unwrap().cut.is_empty()
    }

    /// A fingerprint of every message's time, ends and kind: equal for two runs of
    /// one seed, or the simulation is not deterministic.
    pub fn trace_hash(&self) -> (u64, u64) {
        let s = self.state.lock().unwrap();
        (s.trace_hash, s.messages)
    }

    /// Every message leg so far: (virtual µs, from, to, kind).
    pub fn trace(&self) -> Vec<(u64, usize, usize, u64)> {
        self.state.lock().unwrap().trace.clone()
    }

    /// Waits until `from` and `to` can talk (TCP retransmits across a partition);
    /// false if `to`'s incarnation died meanwhile (the connection was reset).
    async fn path_open(&self, from: ProcessId, to: ProcessId, to_incarnation: u64) -> bool {
        loop {
            let healed = self.healed.notified();
            {
                let s = self.state.lock().unwrap();
                let p = &s.processes[to.0];
                if !p.alive || p.incarnation != to_incarnation {
                    return false;
                }
                if !s.cut.contains(&(from.min(to), from.max(to))) {
                    return true;
                }
            }
            healed.await;
        }
    }

    /// One leg's fate: its delay, and whether the connection breaks on the way.
    fn leg(&self, from: ProcessId, to: ProcessId, leg: Leg, kind: u64) -> (Duration, bool, bool) {
        let mut guard = self.state.lock().unwrap();
        let s = &mut *guard;
        let faults = s.faults;
        let mut delay = Duration::from_nanos(
            s.rng
                .gen_range(1_000..=faults.delay_max.as_nanos().max(1_000) as u64),
        );
        if s.rng.gen_range(0..1_000_000) < faults.spike_per_million {
            delay += Duration::from_nanos(
                s.rng
                    .gen_range(0..=faults.spike_max.as_nanos().max(1) as u64),
            );
        }
        let dropped = s.rng.gen_range(0..1_000_000) < faults.drop_per_million;
        let duplicated = matches!(leg, Leg::Request)
            && s.rng.gen_range(0..1_000_000) < faults.duplicate_per_million;
        let now = self.start.elapsed().as_micros() as u64;
        for word in [
            now,
            from.0 as u64,
            to.0 as u64,
            kind,
            delay.as_nanos() as u64,
        ] {
            s.trace_hash = (s.trace_hash ^ word).wrapping_mul(0x0100_0000_01b3);
        }
        s.messages += 1;
        s.trace.push((now, from.0, to.0, kind));
        if s.messages == MESSAGES_MAX {
            // Some task retries without waiting: virtual time stands still. Every
            // call from here on waits forever, so time moves and the run ends with
            // this violation instead of spinning.
            self.observations.violation(format!(
                "runaway: {MESSAGES_MAX} messages, the last {from:?} -> {to:?} kind {kind}"
            ));
        }
        (delay, dropped, duplicated)
    }

    async fn call(
        self: Arc<Self>,
        from: ProcessId,
        incarnation: u64,
        address: String,
        request: Request,
    ) -> Result<Response, CallError> {
        let closed = || CallError::Closed(address.clone());
        let target = {
            let s = self.state.lock().unwrap();
            let me = &s.processes[from.0];
            if !me.alive || me.incarnation != incarnation {
                None
            } else {
                Some(s.by_address.get(&address).map(|&to| {
                    let p = &s.processes[to.0];
                    (to, p.incarnation, p.service.clone(), p.died.subscribe())
                }))
            }
        };
        // A zombie's calls never leave it, nor does anything after a runaway.
        let runaway = self.state.lock().unwrap().messages >= MESSAGES_MAX;
        let Some(target) = target.filter(|_| !runaway) else {
            return std::future::pending().await;
        };
        let kind = u64::from(request.kind());
        let refused = || CallError::Connect {
            address: address.clone(),
            reason: "connection refused".into(),
        };
        let Some((to, to_incarnation, Some(service), mut died)) = target else {
            tokio::time::sleep(self.leg(from, from, Leg::Request, kind).0).await;
            return Err(refused());
        };

        // The request's leg.
        if !self.path_open(from, to, to_incarnation).await {
            return Err(closed());
        }
        // A sender that died while a partition held its request: its kernel no
        // longer retransmits, so the request never arrives.
        if !self.is_current(from, incarnation) {
            return std::future::pending().await;
        }
        let (delay, dropped, duplicated) = self.leg(from, to, Leg::Request, kind);
        tokio::time::sleep(delay).await;
        if !self.is_current(to, to_incarnation) {
            return Err(closed());
        }
        if dropped {
            return Err(closed());
        }
        if duplicated {
            let (network, service, request) = (self.clone(), service.clone(), request.clone());
            let address = address.clone();
            tokio::spawn(async move {
                let (again, ..) = network.leg(from, to, Leg::Request, kind);
                tokio::time::sleep(again).await;
                if network.is_current(to, to_incarnation) {
                    let response = service(request.clone()).await;
                    network.observations.reply(&request, &response, &address);
                }
            });
        }
        match &request {
            Request::Master(floe_protocol::MasterRequest::Heartbeat { .. }) => {}
            Request::Master(control) => {
                tracing::debug!(from = from.0, to = %address, "delivered {control:?}")
            }
            Request::Replica(control) => {
                tracing::debug!(from = from.0, to = %address, "delivered {control:?}")
            }
            Request::Write { chunk, stamp, .. } | Request::Zero { chunk, stamp, .. } => {
                tracing::trace!(from = from.0, to = %address, ?chunk, ?stamp, "delivered a change")
            }
            _ => {}
        }
        let served = tokio::spawn(service(request.clone()));
        let response = tokio::select! {
            biased;
            response = served => response.expect("a handler panicked"),
            _ = died.wait_for(|died| *died) => return Err(closed()),
        };
        self.observations.reply(&request, &response, &address);

        // The reply's leg.
        if !self.path_open(to, from, incarnation).await {
            return std::future::pending().await;
        }
        let (delay, dropped, _) = self.leg(to, from, Leg::Reply, kind);
        tokio::time::sleep(delay).await;
        if !self.is_current(from, incarnation) {
            return std::future::pending().await;
        }
        if dropped || !self.is_current(to, to_incarnation) {
            return Err(closed());
        }
        match response {
            Response::Error { status, message } => Err(CallError::Remote { status, message }),
            response => Ok(response),
        }
    }
}

/// One incarnation of a process's view of the network.
pub struct SimTransport {
    network: Arc<Network>,
    from: ProcessId,
    incarnation: u64,
}

impl SimTransport {
    pub fn process(&self) -> ProcessId {
        self.from
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub fn network(&self) -> &Arc<Network> {
        &self.network
    }
}

impl Transport for SimTransport {
    fn call<'a>(&'a self, address: &'a str, request: Request) -> CallFuture<'a> {
        Box::pin(self.network.clone().call(
            self.from,
            self.incarnation,
            address.to_string(),
            request,
        ))
    }

    fn forget(&self, _address: &str) {}
}
