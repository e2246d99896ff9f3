//! Compute shares on a node: the agent's half of the arbitration (design: `docs/compute.md`).
//! A process under the shim opens the agent's socket, names its slice, and then asks for the GPU
//! (`"acquire"`), gets it (`"grant"`), and gives it back (`"release"`) once the work it queued has
//! finished; the agent asks a holder to stop (`"yield"`) when its cap is reached or a waiter should
//! go next, and the holder says when it has launched its last kernel (`"stopped"`). Every decision is [`gpuslice_node::workloads::arbiter::Arbiter`]'s, one per GPU; this module only
//! carries messages and time. All state is in the agent: nothing a workload writes grants time.

use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use gpuslice_contract::socket::{Compute as Message, Ready, Reply};
use gpuslice_contract::{SliceConfig, SliceKind};

use crate::workloads::arbiter::{Arbiter, ClientId, Order, Share, Usage};
use crate::workloads::claims::{Claim, Need};
use crate::workloads::process::{ancestry, pod_of};

/// With nothing due, the arbiters' timer still looks this often (ns).
const TIMER_IDLE_NS: u64 = 1_000_000_000;
/// The timer never sleeps less than this (ns): a deadline just passed is served on waking.
const TIMER_MIN_WAIT_NS: u64 = 50_000;

/// The default minimum slice when a pool names none.
pub const DEFAULT_TIME_SLICE: Duration = Duration::from_millis(10);

/// The shares of one GPU's slices and its minimum slice.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuShares {
    pub time_slice: Duration,
    pub slices: BTreeMap<String, Share>,
}

/// Now on the monotonic clock (ns).
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

struct Connection {
    stream: UnixStream,
}

#[derive(Default)]
struct Hub {
    gpus: BTreeMap<u32, Arbiter>,
    /// Slice → its GPU.
    slice_gpu: BTreeMap<String, u32>,
    connections: HashMap<ClientId, Connection>,
    next: ClientId,
    /// GPU → the holder last told it is contended.
    told: HashMap<u32, ClientId>,
}

impl Hub {
    /// Runs the GPU's arbiter now and sends what it decided.
    fn step(&mut self, gpu: u32, now: u64) {
        let Some(arbiter) = self.gpus.get_mut(&gpu) else {
            return;
        };
        for order in arbiter.step(now) {
            let (client, message) = match order {
                Order::Grant(c) => {
                    // A new grant: the shim forgets it was contended, so tell it again.
                    self.told.remove(&gpu);
                    if arbiter.limit_of(c) == Some(100) && !arbiter.has_waiters(c) {
                        (c, Message::Free)
                    } else {
                        (c, Message::Grant)
                    }
                }
                Order::Yield(c) => (c, Message::Yield),
            };
            if let Some(conn) = self.connections.get(&client) {
                send(&conn.stream, &message);
            }
        }
        if let Some(holder) = arbiter.holder()
            && arbiter.has_waiters(holder)
            && self.told.get(&gpu) != Some(&holder)
        {
            self.told.insert(gpu, holder);
            if let Some(conn) = self.connections.get(&holder) {
                send(&conn.stream, &Message::Contended);
            }
        }
    }
}

/// Sends without blocking the arbiter: a client that does not read its socket is cut off (its
/// connection thread then sees the end and the arbiter forgets it).
fn send(stream: &UnixStream, message: &impl serde::Serialize) {
    use rustix::net::{SendFlags, send};
    let line = gpuslice_contract::socket::line(message);
    let sent = send(stream, &line, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
    if !matches!(sent, Ok(n) if n == line.len()) {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

/// The node's compute arbiters, shared by the socket's connections and a timer thread.
#[derive(Default)]
pub struct Compute {
    hub: Mutex<Hub>,
    changed: Condvar,
}

impl Compute {
    fn lock(&self) -> std::sync::MutexGuard<'_, Hub> {
        self.hub.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets every GPU's slices and shares (the agent after each pass, a benchmark once).
    pub fn set(&self, gpus: &BTreeMap<u32, GpuShares>) {
        let now = now_ns();
        let mut hub = self.lock();
        hub.slice_gpu = gpus
            .iter()
            .flat_map(|(gpu, s)| s.slices.keys().map(|id| (id.clone(), *gpu)))
            .collect();
        for (gpu, shares) in gpus {
            let time_slice = shares.time_slice.as_nanos() as u64;
            let arbiter = hub
                .gpus
                .entry(*gpu)
                .or_insert_with(|| Arbiter::new(time_slice, now));
            arbiter.set_time_slice(time_slice);
            arbiter.set_shares(&shares.slices, now);
        }
        for (gpu, arbiter) in hub.gpus.iter_mut() {
            if !gpus.contains_key(gpu) {
                arbiter.set_shares(&BTreeMap::new(), now);
            }
        }
        self.changed.notify_all();
    }

    /// Each software slice's cap (%), the arbiters' own: what the watchdog holds measured use to.
    pub fn limits(&self) -> BTreeMap<String, u32> {
        self.lock().gpus.values().flat_map(|a| a.limits()).collect()
    }

    /// What each slice has had until now, per GPU, and how often each GPU changed hands.
    pub fn usage(&self) -> BTreeMap<u32, (BTreeMap<String, Usage>, u64)> {
        let now = now_ns();
        self.lock()
            .gpus
            .iter_mut()
            .map(|(gpu, a)| (*gpu, (a.usage_at(now), a.switches())))
            .collect()
    }

    /// Starts the thread that issues yields and grants that fall due with time.
    pub fn start_timer(self: &Arc<Self>) {
        let compute = Arc::clone(self);
        std::thread::spawn(move || {
            let mut hub = compute.lock();
            loop {
                let now = now_ns();
                let gpus: Vec<u32> = hub.gpus.keys().copied().collect();
                let mut wake = now + TIMER_IDLE_NS;
                for gpu in gpus {
                    hub.step(gpu, now);
                    if let Some(at) = hub.gpus[&gpu].next_wake(now) {
                        wake = wake.min(at);
                    }
                }
                let timeout =
                    Duration::from_nanos(wake.saturating_sub(now_ns()).max(TIMER_MIN_WAIT_NS));
                hub = compute
                    .changed
                    .wait_timeout(hub, timeout)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        });
    }

    /// Serves one process of `slice` until it hangs up. `claims` are the node's claims now:
    /// a claimed slice takes processes of its claimant only, and a claimant's processes take no
    /// other slice, so no process can spend a neighbour's budget.
    pub fn serve(
        &self,
        stream: UnixStream,
        mut reader: BufReader<UnixStream>,
        slice: &str,
        peer: u32,
        claims: &[Claim],
    ) -> std::io::Result<()> {
        if let Err(reason) = authorize(slice, &ancestry(peer), pod_of(peer).as_deref(), claims) {
            send(&stream, &Reply::Refused { reason });
            return Ok(());
        }
        let (id, gpu, time_slice) = {
            let mut hub = self.lock();
            let Some(gpu) = hub.slice_gpu.get(slice).copied() else {
                drop(hub);
                send(
                    &stream,
                    &Reply::Refused {
                        reason: format!("slice {slice} has no compute share on this node"),
                    },
                );
                return Ok(());
            };
            hub.next += 1;
            let id = hub.next;
            let arbiter = hub
                .gpus
                .get_mut(&gpu)
                .expect("a GPU with slices has an arbiter");
            if let Err(e) = arbiter.connect(id, slice) {
                drop(hub);
                send(
                    &stream,
                    &Reply::Refused {
                        reason: e.to_string(),
                    },
                );
                return Ok(());
            }
            let time_slice = arbiter.time_slice();
            hub.connections.insert(
                id,
                Connection {
                    stream: stream.try_clone()?,
                },
            );
            (id, gpu, time_slice)
        };
        send(
            &stream,
            &Ready {
                time_slice_us: time_slice / 1_000,
            },
        );
        let mut line = String::new();
        while gpuslice_contract::socket::read_line(&mut reader, &mut line).unwrap_or(0) > 0 {
            let message = Message::from_wire(&line);
            line.clear();
            let now = now_ns();
            let mut hub = self.lock();
            let Some(arbiter) = hub.gpus.get_mut(&gpu) else {
                break;
            };
            match message {
                Some(Message::Acquire) => arbiter.acquire(id, now),
                Some(Message::Release) => arbiter.release(id, now),
                Some(Message::Stopped) => arbiter.stopped(id, now),
                // Anything else ends the conversation (and with it the process's turn).
                _ => break,
            }
            hub.step(gpu, now);
            self.changed.notify_all();
        }
        let now = now_ns();
        let mut hub = self.lock();
        hub.connections.remove(&id);
        if let Some(arbiter) = hub.gpus.get_mut(&gpu) {
            arbiter.disconnect(id, now);
        }
        hub.step(gpu, now);
        self.changed.notify_all();
        Ok(())
    }
}

/// Whether a process (given with its ancestors) may draw on `slice`'s compute budget.
fn authorize(
    slice: &str,
    ancestry: &[u32],
    pod: Option<&str>,
    claims: &[Claim],
) -> Result<(), String> {
    let owns = |c: &Claim| {
        (c.resource_claim.is_none() && ancestry.contains(&c.client))
            || c.workload.is_some_and(|w| ancestry.contains(&w))
            || pod.is_some_and(|p| c.pods.iter().any(|u| u == p))
    };
    if let Some(other) = claims.iter().find(|c| c.slice != slice && owns(c)) {
        return Err(format!(
            "this process belongs to the claim on slice {}, not {slice}",
            other.slice
        ));
    }
    let holders: Vec<&Claim> = claims.iter().filter(|c| c.slice == slice).collect();
    if !holders.is_empty() && !holders.iter().any(|c| owns(c)) {
        return Err(format!(
            "slice {slice} is claimed by another workload (pid {})",
            holders[0].workload.unwrap_or(holders[0].client)
        ));
    }
    Ok(())
}

/// The shares of each GPU's software slices: weight and cap are the slice's compute share; a
/// claim whose policy names a compute limit lowers the cap and adds its guarantee.
pub fn shares(
    slices: &[SliceConfig],
    claims: &[Claim],
    policies: &BTreeMap<String, Need>,
    time_slices: &BTreeMap<u32, Duration>,
) -> BTreeMap<u32, GpuShares> {
    let mut gpus: BTreeMap<u32, GpuShares> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.kind == SliceKind::Software) {
        let mut share = Share::capped(slice.compute_percent.clamp(1, 100));
        let policy = claims
            .iter()
            .find(|c| c.slice == slice.id)
            .and_then(|c| c.policy.as_ref())
            .and_then(|p| policies.get(p));
        if let Some(need) = policy.filter(|n| n.compute > 0) {
            share.limit = need.compute.min(share.limit);
            share.guarantee = need.guarantee.min(share.limit);
        }
        let gpu = gpus.entry(slice.gpu).or_insert_with(|| GpuShares {
            time_slice: time_slices
                .get(&slice.gpu)
                .copied()
                .unwrap_or(DEFAULT_TIME_SLICE),
            slices: BTreeMap::new(),
        });
        gpu.slices.insert(slice.id.clone(), share);
    }
    gpus
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(slice: &str, client: u32, workload: Option<u32>) -> Claim {
        Claim {
            slice: slice.into(),
            client,
            workload,
            policy: None,
            resource_claim: None,
            pods: Vec::new(),
            pod_names: Vec::new(),
        }
    }

    #[test]
    fn a_process_draws_only_on_its_own_claims_slice() {
        let claims = [
            claim("gpu0-s0", 100, Some(101)),
            claim("gpu0-s1", 200, Some(201)),
        ];
        // The workload of s0 and its children: s0 only.
        assert_eq!(
            authorize("gpu0-s0", &[150, 101, 100], None, &claims),
            Ok(())
        );
        let stolen = authorize("gpu0-s1", &[150, 101, 100], None, &claims).unwrap_err();
        assert!(stolen.contains("claim on slice gpu0-s0"), "{stolen}");
        // A stranger cannot spend a claimed slice's budget.
        let stranger = authorize("gpu0-s0", &[999, 998], None, &claims).unwrap_err();
        assert!(
            stranger.contains("claimed by another workload"),
            "{stranger}"
        );
        // An unclaimed slice (a container given the slice's config directly) is open.
        assert_eq!(authorize("gpu0-s2", &[999, 998], None, &claims), Ok(()));
    }

    #[test]
    fn a_prepared_resource_claim_belongs_to_its_pods_processes() {
        let mut by_pod = claim("gpu0-s3", 0, None);
        by_pod.resource_claim = Some("default/notebook-0-gpu".into());
        by_pod.pods = vec!["pod-a".into()];
        let claims = [claim("gpu0-s0", 100, Some(101)), by_pod];
        assert_eq!(
            authorize("gpu0-s3", &[4000, 3999], Some("pod-a"), &claims),
            Ok(())
        );
        let other_pod = authorize("gpu0-s3", &[5000], Some("pod-b"), &claims).unwrap_err();
        assert!(
            other_pod.contains("claimed by another workload"),
            "{other_pod}"
        );
        let host = authorize("gpu0-s3", &[6000], None, &claims).unwrap_err();
        assert!(host.contains("claimed by another workload"), "{host}");
        // The pod's processes cannot spend another claim's slice either.
        assert!(authorize("gpu0-s0", &[4000], Some("pod-a"), &claims).is_err());
    }

    #[test]
    fn a_policy_lowers_the_cap_and_adds_its_guarantee() {
        let slice = |id: &str, gpu: u32| SliceConfig {
            id: id.into(),
            kind: SliceKind::Software,
            gpu,
            device_minor: None,
            device_uuid: "GPU-x".into(),
            memory_bytes: 1 << 30,
            compute_percent: 50,
        };
        let mut c = claim("gpu0-s0", 1, None);
        c.policy = Some("train".into());
        let policies = [(
            "train".to_string(),
            Need {
                compute: 30,
                guarantee: 20,
                ..Need::default()
            },
        )]
        .into();
        let time_slices = [(1, Duration::from_millis(50))].into();
        let out = shares(
            &[
                slice("gpu0-s0", 0),
                slice("gpu0-s1", 0),
                slice("gpu1-s0", 1),
            ],
            &[c],
            &policies,
            &time_slices,
        );
        assert_eq!(
            out[&0].slices["gpu0-s0"],
            Share {
                weight: 50,
                limit: 30,
                guarantee: 20
            }
        );
        assert_eq!(out[&0].slices["gpu0-s1"], Share::capped(50));
        assert_eq!(out[&0].time_slice, DEFAULT_TIME_SLICE);
        assert_eq!(out[&1].time_slice, Duration::from_millis(50));
    }
}
