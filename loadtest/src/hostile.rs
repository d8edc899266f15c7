//! `pdmesh-load hostile`: the attackers of issue 40's mixed hostile load, all at once for a
//! duration, while honest streams (`pdmesh-load run`) and a frontend killer run beside them
//! (`loadtest/scenarios/hostile.sh`). Three kinds, each the shape of a defect issue 40 found:
//!
//! - **schema**: over HTTP, a chat request whose `response_format` schema is a 300-step `$ref`
//!   chain (it once overflowed the frontend's stack) and a completions request with 100,000
//!   `guided_choice` strings (~1 MB; it once took 29 s to refuse), alternately, against the
//!   router and any frontend named with `--also-url`. Both must be refused with a 400 at once;
//!   every answer is counted by kind and the 400s' latency kept.
//! - **silent peers**: raw ZeroMQ DEALERs on P's side channel that send bulky frames (a request
//!   id and a trace of `--frame-kib` each, which P once echoed into an unbounded queue) and never
//!   read; a few at a time, each reopened when P drops it (how soon P drops them is reported).
//! - **handshake flood**: thousands of DEALERs that each send an `AuthHello` and repeat it,
//!   never answering the challenge (they once kept every handshake slot busy), each reconnected
//!   when P drops it.
//!
//! This is a client of a server under attack, so nothing here unwraps or panics on the
//! network: every failure is a counted outcome. The report (`hostile.json`, schema
//! `pdmesh-load/hostile/v1`) says what each attacker sent and got.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt as _;
use pdmesh_mesh_auth::{Channel, ClientHello};
use pdmesh_protocol::{Envelope, Message, TraceContext};
use serde::Serialize;
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketSend, ZmqMessage};

use crate::load::{refusal_kind, retry_after_s};
use crate::stats::{summarize, Summary};

#[derive(Args, Clone, Debug, Serialize)]
pub struct HostileArgs {
    /// Base URL of the router (or any frontend) the schema attackers send to (no `/v1`).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// More frontends the schema attackers send to directly, e.g. P's and D's (repeatable).
    #[arg(long)]
    pub also_url: Vec<String>,
    /// P's KV side channel, `tcp://HOST:PORT`: the silent peers and the handshake flood go
    /// there (without it only the schema attackers run).
    #[arg(long)]
    pub side_channel: Option<String>,
    /// Seconds the attackers run (requests in flight then still finish).
    #[arg(long, default_value_t = 300.0)]
    pub duration: f64,
    /// Schema attackers per URL, each sending its requests one after another.
    #[arg(long, default_value_t = 1)]
    pub schema_clients: usize,
    /// A schema attacker's pause between two requests, ms: the point is what a hostile request
    /// does to the mesh, not how many a 2-core host can send.
    #[arg(long, default_value_t = 100)]
    pub schema_pause_ms: u64,
    /// `$ref` steps of the deep schema.
    #[arg(long, default_value_t = 300)]
    pub ref_depth: usize,
    /// Strings of the huge `guided_choice`.
    #[arg(long, default_value_t = 100_000)]
    pub choices: usize,
    /// A schema request's time limit, s (past it: `timeout`).
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_s: f64,
    /// Silent peers on the side channel at a time.
    #[arg(long, default_value_t = 4)]
    pub silent_peers: usize,
    /// KiB of a silent peer's request id, and again of its trace, in each frame.
    #[arg(long, default_value_t = 200)]
    pub frame_kib: usize,
    /// Frames a silent peer sends on one connection at most before it opens another.
    #[arg(long, default_value_t = 2000)]
    pub frames_per_connection: u64,
    /// A silent peer's pause before it opens its next connection, ms.
    #[arg(long, default_value_t = 250)]
    pub reopen_pause_ms: u64,
    /// Handshake flood: connections, each sending `AuthHello`s (0: no flood).
    #[arg(long, default_value_t = 2000)]
    pub flood_connections: usize,
    /// Interval between two hellos of one flood connection, and a dropped one's pause before
    /// it reconnects, ms.
    #[arg(long, default_value_t = 1000)]
    pub flood_resend_ms: u64,
    /// Write `hostile.json` here (default: print it on stdout).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

/// How long a send may wait for the socket's queue before the peer counts as stalled (the
/// queue holds 100,000 messages, so in practice only a hello on a wedged connection waits).
const SEND_STALL: Duration = Duration::from_secs(2);
/// How long a silent peer waits, its frames queued, for P to drop its connection.
const DROP_WAIT: Duration = Duration::from_secs(30);
/// Time limit of one ZeroMQ connect (TCP and the ZMTP greeting).
const CONNECT_LIMIT: Duration = Duration::from_secs(5);

/// A schema attack: which request it sends.
#[derive(Clone, Copy)]
enum Attack {
    DeepRef,
    HugeChoice,
}

impl Attack {
    fn name(self) -> &'static str {
        match self {
            Attack::DeepRef => "deep_ref",
            Attack::HugeChoice => "huge_choice",
        }
    }
}

/// A JSON schema whose root is a chain of `depth` `$ref`s, each an object whose one property
/// is the next (the shape that overflowed the frontend's stack at 300; as in
/// `services/pdmesh/tests/hostile.rs`).
fn ref_chain(depth: usize) -> serde_json::Value {
    let mut defs = serde_json::Map::new();
    for i in 0..depth {
        let next = if i + 1 == depth {
            serde_json::json!({"type": "integer"})
        } else {
            serde_json::json!({
                "type": "object",
                "properties": {"x": {"$ref": format!("#/$defs/a{}", i + 1)}},
                "required": ["x"],
            })
        };
        defs.insert(format!("a{i}"), next);
    }
    serde_json::json!({"$ref": "#/$defs/a0", "$defs": defs})
}

/// The two hostile bodies, serialised once (the huge one is ~1 MB).
struct Bodies {
    deep_ref: bytes::Bytes,
    huge_choice: bytes::Bytes,
}

impl Bodies {
    fn new(a: &HostileArgs) -> anyhow::Result<Self> {
        let rf =
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(a.ref_depth)}});
        let deep = serde_json::json!({
            "messages": [{"role": "user", "content": "n"}],
            "max_tokens": 8,
            "response_format": rf,
        });
        let choices: Vec<String> = (0..a.choices).map(|i| format!("choice {i}")).collect();
        let huge = serde_json::json!({"prompt": "n", "max_tokens": 8, "guided_choice": choices});
        Ok(Self { deep_ref: serde_json::to_vec(&deep)?.into(), huge_choice: serde_json::to_vec(&huge)?.into() })
    }

    fn get(&self, attack: Attack) -> (&'static str, bytes::Bytes) {
        match attack {
            Attack::DeepRef => ("/v1/chat/completions", self.deep_ref.clone()),
            Attack::HugeChoice => ("/v1/completions", self.huge_choice.clone()),
        }
    }
}

/// What one (target, attack) pair got.
#[derive(Default)]
struct HttpTally {
    sent: u64,
    /// `http_<status>` as [`refusal_kind`] names it (`http_200` for a success), `connect`,
    /// `timeout` or `transport`.
    outcomes: BTreeMap<String, u64>,
    latency_400_ms: Vec<f64>,
    latency_max_ms: f64,
}

#[derive(Serialize)]
struct HttpReport {
    target: String,
    attack: &'static str,
    sent: u64,
    outcomes: BTreeMap<String, u64>,
    /// Time to a complete 400 answer.
    latency_400_ms: Summary,
    latency_400_max_ms: f64,
    /// The slowest answer or failure of any kind.
    latency_max_ms: f64,
}

type Tallies = Arc<Mutex<BTreeMap<(String, &'static str), HttpTally>>>;

/// One schema attacker: `Attack`s in turn against `url` until `deadline`.
async fn schema_attacker(
    client: reqwest::Client,
    url: String,
    bodies: Arc<Bodies>,
    pause: Duration,
    deadline: Instant,
    tallies: Tallies,
) {
    let mut next = Attack::DeepRef;
    while Instant::now() < deadline {
        let attack = next;
        next = match attack {
            Attack::DeepRef => Attack::HugeChoice,
            Attack::HugeChoice => Attack::DeepRef,
        };
        let (path, body) = bodies.get(attack);
        let started = Instant::now();
        let sent = client
            .post(format!("{url}{path}"))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await;
        let outcome = match sent {
            Ok(r) => {
                let status = r.status().as_u16();
                let retry_after = retry_after_s(r.headers()).is_some();
                match r.bytes().await {
                    Ok(_) if status < 300 => format!("http_{status}"),
                    Ok(b) => refusal_kind(status, retry_after, &b),
                    Err(e) if e.is_timeout() => "timeout".into(),
                    Err(_) => "transport".into(),
                }
            }
            Err(e) if e.is_timeout() => "timeout".into(),
            Err(e) if e.is_connect() => "connect".into(),
            Err(_) => "transport".into(),
        };
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        if let Ok(mut t) = tallies.lock() {
            let t = t.entry((url.clone(), attack.name())).or_default();
            t.sent += 1;
            t.latency_max_ms = t.latency_max_ms.max(ms);
            if outcome == "http_400" {
                t.latency_400_ms.push(ms);
            }
            *t.outcomes.entry(outcome).or_default() += 1;
        }
        tokio::time::sleep(pause).await;
    }
}

/// Counters of the ZeroMQ attackers.
#[derive(Default)]
struct ZmqCounters {
    connects: AtomicU64,
    connect_failures: AtomicU64,
    frames: AtomicU64,
    bytes: AtomicU64,
    /// Connections P closed: a send refused (the socket has no peer left) or, for a silent
    /// peer, the socket's report that its connection went.
    dropped: AtomicU64,
    /// A send blocked for [`SEND_STALL`].
    stalled: AtomicU64,
    /// Silent peers: connections P had not dropped [`DROP_WAIT`] after they were opened.
    held_open: AtomicU64,
    /// Silent peers: the longest time from connect to P's drop, ms.
    drop_ms_max: AtomicU64,
}

#[derive(Serialize)]
struct ZmqReport {
    connects: u64,
    connect_failures: u64,
    /// Frames the sockets took: a send returns once the socket's queue has the frame, so for a
    /// silent peer this is what it offered, not what P read.
    frames_sent: u64,
    bytes_sent: u64,
    dropped_by_p: u64,
    stalled: u64,
    /// Silent peers only (see [`ZmqCounters`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    held_open: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    drop_ms_max: Option<u64>,
}

impl ZmqCounters {
    /// The counters; the silent peers' own only for them.
    fn report(&self, silent: bool) -> ZmqReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ZmqReport {
            connects: get(&self.connects),
            connect_failures: get(&self.connect_failures),
            frames_sent: get(&self.frames),
            bytes_sent: get(&self.bytes),
            dropped_by_p: get(&self.dropped),
            stalled: get(&self.stalled),
            held_open: silent.then(|| get(&self.held_open)),
            drop_ms_max: silent.then(|| get(&self.drop_ms_max)),
        }
    }
}

/// A DEALER connected to `endpoint`, or `None` (counted) when the connect fails or hangs.
async fn connect(endpoint: &str, counters: &ZmqCounters) -> Option<DealerSocket> {
    let mut socket = DealerSocket::new();
    match tokio::time::timeout(CONNECT_LIMIT, socket.connect(endpoint)).await {
        Ok(Ok(())) => {
            counters.connects.fetch_add(1, Ordering::Relaxed);
            Some(socket)
        }
        _ => {
            counters.connect_failures.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// How a send ended.
enum Sent {
    Ok,
    Dropped,
    Stalled,
}

/// Send `frame` on `socket`; a frame taken is counted, a failure is the caller's to count.
async fn send(socket: &mut DealerSocket, frame: &bytes::Bytes, counters: &ZmqCounters) -> Sent {
    match tokio::time::timeout(SEND_STALL, socket.send(ZmqMessage::from(frame.clone()))).await {
        Ok(Ok(())) => {
            counters.frames.fetch_add(1, Ordering::Relaxed);
            counters.bytes.fetch_add(frame.len() as u64, Ordering::Relaxed);
            Sent::Ok
        }
        Ok(Err(_)) => Sent::Dropped,
        Err(_) => Sent::Stalled,
    }
}

/// A stranger's bulky frame: a request id and a trace of `kib` KiB each (what P once echoed).
fn bulky_frame(kib: usize) -> anyhow::Result<bytes::Bytes> {
    let big = "x".repeat(kib * 1024);
    let env = Envelope::new(Message::XferGetMetadata)
        .with_request_id(big.clone())
        .with_corr(7)
        .with_trace(TraceContext { traceparent: Some(big), tracestate: None });
    Ok(env.encode().context("encoding the bulky frame")?.into())
}

/// One silent peer: connect, queue `per_connection` bulky frames and never read; wait (at most
/// [`DROP_WAIT`]) for P to drop the connection, which the socket reports when writing to it
/// fails; pause, again, until `deadline`. The socket's queue takes every frame at once, so
/// what P reads of them is up to P: the figure that matters is that P drops the peer, and how
/// soon.
async fn silent_peer(
    endpoint: String,
    frame: bytes::Bytes,
    per_connection: u64,
    pause: Duration,
    deadline: Instant,
    counters: Arc<ZmqCounters>,
) {
    while Instant::now() < deadline {
        if let Some(mut socket) = connect(&endpoint, &counters).await {
            let opened = Instant::now();
            let mut events = socket.monitor();
            let mut refused = false;
            for _ in 0..per_connection {
                match send(&mut socket, &frame, &counters).await {
                    Sent::Ok => {}
                    Sent::Dropped => {
                        refused = true;
                        break;
                    }
                    Sent::Stalled => {
                        counters.stalled.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            let gone = refused
                || tokio::time::timeout_at((opened + DROP_WAIT).min(deadline), async {
                    while let Some(event) = events.next().await {
                        if matches!(event, SocketEvent::Disconnected(_)) {
                            return true;
                        }
                    }
                    false
                })
                .await
                .unwrap_or(false);
            if gone {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
                counters.drop_ms_max.fetch_max(opened.elapsed().as_millis() as u64, Ordering::Relaxed);
            } else if Instant::now() < deadline {
                counters.held_open.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(pause).await;
    }
}

/// A fresh `AuthHello` frame for the side channel (a stranger never gets further).
fn hello_frame() -> anyhow::Result<bytes::Bytes> {
    let (_, hello) = ClientHello::new(Channel::SideChannel);
    Ok(Envelope::new(Message::AuthHello(hello)).encode().context("encoding a hello")?.into())
}

/// One flood connection: connect, say hello every `interval` and never answer the challenge;
/// when P drops it, reconnect after `interval`. Starts after `delay` (the flood ramps up).
async fn flooder(endpoint: String, interval: Duration, delay: Duration, deadline: Instant, counters: Arc<ZmqCounters>) {
    tokio::time::sleep(delay).await;
    let Ok(hello) = hello_frame() else { return };
    while Instant::now() < deadline {
        if let Some(mut socket) = connect(&endpoint, &counters).await {
            while Instant::now() < deadline {
                match send(&mut socket, &hello, &counters).await {
                    Sent::Ok => {}
                    Sent::Dropped => {
                        counters.dropped.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    Sent::Stalled => {
                        counters.stalled.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
                tokio::time::sleep_until((Instant::now() + interval).min(deadline)).await;
            }
        }
        tokio::time::sleep_until((Instant::now() + interval).min(deadline)).await;
    }
}

#[derive(Serialize)]
struct Report {
    schema: &'static str,
    config: HostileArgs,
    duration_s: f64,
    schema_attacks: Vec<HttpReport>,
    silent_peers: Option<ZmqReport>,
    handshake_flood: Option<ZmqReport>,
}

/// Raise this process's open-file limit to its hard limit when `want` descriptors would not
/// fit under the soft one (each flood connection is one).
fn raise_nofile(want: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < want && soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

pub async fn run(a: HostileArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.duration > 0.0, "--duration must be positive");
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(a.duration);
    let mut tasks = Vec::new();

    let client = reqwest::Client::builder().timeout(Duration::from_secs_f64(a.request_timeout_s)).build()?;
    let bodies = Arc::new(Bodies::new(&a)?);
    let tallies: Tallies = Arc::default();
    let urls: Vec<String> =
        std::iter::once(&a.url).chain(&a.also_url).map(|u| u.trim_end_matches('/').to_string()).collect();
    for url in &urls {
        for _ in 0..a.schema_clients {
            tasks.push(tokio::spawn(schema_attacker(
                client.clone(),
                url.clone(),
                bodies.clone(),
                Duration::from_millis(a.schema_pause_ms),
                deadline,
                tallies.clone(),
            )));
        }
    }

    let silent = Arc::new(ZmqCounters::default());
    let flood = Arc::new(ZmqCounters::default());
    if let Some(endpoint) = &a.side_channel {
        raise_nofile(a.flood_connections as u64 + a.silent_peers as u64 + 1024);
        let frame = bulky_frame(a.frame_kib)?;
        for _ in 0..a.silent_peers {
            tasks.push(tokio::spawn(silent_peer(
                endpoint.clone(),
                frame.clone(),
                a.frames_per_connection.max(1),
                Duration::from_millis(a.reopen_pause_ms),
                deadline,
                silent.clone(),
            )));
        }
        let interval = Duration::from_millis(a.flood_resend_ms.max(1));
        for i in 0..a.flood_connections {
            // Connections spread over the first interval, not all in one burst of connects.
            let delay = interval.mul_f64(i as f64 / a.flood_connections as f64);
            tasks.push(tokio::spawn(flooder(endpoint.clone(), interval, delay, deadline, flood.clone())));
        }
    }
    for t in tasks {
        let _ = t.await;
    }

    let schema_attacks = tallies
        .lock()
        .map_err(|_| anyhow::anyhow!("tallies lock poisoned"))?
        .iter()
        .map(|((target, attack), t)| HttpReport {
            target: target.clone(),
            attack,
            sent: t.sent,
            outcomes: t.outcomes.clone(),
            latency_400_ms: summarize(&t.latency_400_ms),
            latency_400_max_ms: t.latency_400_ms.iter().copied().fold(0.0, f64::max),
            latency_max_ms: t.latency_max_ms,
        })
        .collect();
    let zmq = a.side_channel.is_some();
    let report = Report {
        schema: "pdmesh-load/hostile/v1",
        duration_s: t0.elapsed().as_secs_f64(),
        schema_attacks,
        silent_peers: zmq.then(|| silent.report(true)),
        handshake_flood: zmq.then(|| flood.report(false)),
        config: a.clone(),
    };
    let json = serde_json::to_string_pretty(&report)?;
    match &a.out_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(dir.join("hostile.json"), &json)?;
            eprintln!("wrote {}/hostile.json", dir.display());
        }
        None => println!("{json}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ref_chain_is_as_deep_as_asked() {
        let schema = ref_chain(300);
        let defs = schema["$defs"].as_object().unwrap();
        assert_eq!(defs.len(), 300);
        assert_eq!(schema["$ref"], "#/$defs/a0");
        assert_eq!(defs["a0"]["properties"]["x"]["$ref"], "#/$defs/a1");
        assert_eq!(defs["a299"]["type"], "integer");
    }

    #[test]
    fn the_hostile_bodies_have_their_sizes() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct W {
            #[command(flatten)]
            a: HostileArgs,
        }
        let a = W::try_parse_from(["x"]).unwrap().a;
        let bodies = Bodies::new(&a).unwrap();
        let huge: serde_json::Value = serde_json::from_slice(&bodies.huge_choice).unwrap();
        assert_eq!(huge["guided_choice"].as_array().unwrap().len(), 100_000);
        assert!(bodies.huge_choice.len() > 1_000_000, "{} bytes", bodies.huge_choice.len());
        let frame = bulky_frame(200).unwrap();
        assert!(frame.len() > 400 * 1024, "a request id and a trace of 200 KiB each");
        let hello = Envelope::decode(&hello_frame().unwrap()).unwrap();
        assert!(matches!(hello.body, Message::AuthHello(_)));
    }
}
