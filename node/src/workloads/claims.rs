//! Slice claims: `gpuslice run` asks the agent for a slice over the agent's socket (messages:
//! `gpuslice_contract::socket`), waits in line when none is free, and holds the slice for as long
//! as it keeps the connection open, so a claim can never outlive its holder. The agent identifies
//! callers by the socket's peer credentials, records the workload's pid, and treats a claimed
//! slice as busy: re-slicing it is blocked like destroying a busy MIG instance. Claims work the
//! same in both modes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use gpuslice_contract::socket::{self, Checkpointing, Reply, Request, Want};
use gpuslice_contract::{SliceConfig, SliceKind, StateDir};
use gpuslice_source::last_good::Config;
use serde::Serialize;

use crate::workloads::process::parent_of;

/// How often a waiting claim looks whether its client hung up.
const HANGUP_CHECK: Duration = Duration::from_millis(500);

/// What a request needs from a slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Need {
    pub memory: u64,
    /// The policy's compute limit (0: none).
    pub compute: u32,
    /// The policy's compute guarantee (0: none).
    pub guarantee: u32,
    /// The policy's pool: only slices of its GPUs will do.
    pub pool: Option<String>,
    /// The policy's host CPU and memory (`spec.host`).
    pub host: crate::protections::hostlimit::HostLimit,
    /// Only this slice ([`Want::slice`]: a workload's slice claimed again).
    pub only: Option<String>,
    /// The policy's own CheckpointPolicy, as its workload is told (else its GPU's pool's).
    pub checkpoint: Option<Checkpointing>,
    /// Slices per workload the policy gives (`spec.count`; 0 read as 1).
    pub count: u32,
}

impl Need {
    /// Whether `slice` fits, its GPU belonging to `pool_of_gpu`'s pool.
    fn fits(&self, slice: &SliceConfig, pool_of_gpu: &BTreeMap<u32, String>) -> bool {
        slice.memory_bytes >= self.memory
            && slice.compute_percent >= self.compute
            && self.only.as_ref().is_none_or(|id| *id == slice.id)
            && self
                .pool
                .as_ref()
                .is_none_or(|pool| pool_of_gpu.get(&slice.gpu) == Some(pool))
    }
}

/// A claim held by a connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    pub slice: String,
    /// The `gpuslice run` process (peer credentials).
    pub client: u32,
    /// The workload it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<u32>,
    /// The policy it asked with: its compute limit and guarantee govern the slice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// A ResourceClaim the kubelet had prepared (`namespace/name`): held by its pods (their
    /// UIDs), not by a connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_claim: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// The same pods as `namespace/name`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pod_names: Vec<String>,
}

#[derive(Default)]
struct Board {
    slices: Vec<SliceConfig>,
    /// GPU index → the pool it belongs to now.
    pools: BTreeMap<u32, String>,
    /// Policy name → need.
    policies: BTreeMap<String, Need>,
    claims: HashMap<u64, Claim>,
    /// Slices held by prepared ResourceClaims.
    pinned: Vec<Claim>,
    /// Slices of ResourceClaims being prepared, until a pass finds them recorded as prepared
    /// (then they are in `pinned`) or the preparation fails.
    preparing: Vec<Claim>,
    queue: VecDeque<(u64, Need, Option<String>)>,
    refused: HashMap<u64, String>,
    next: u64,
    /// What `gpuslice run` commands are held to.
    limits: Limits,
    /// Slices no new claim gets (quarantined after an XID, or software slices on a driver too
    /// old for the shim); a claim waits for another.
    closed: std::collections::BTreeSet<String>,
    /// Slices an elastic re-cut could give (their `id` empty): a request one of them fits
    /// waits for the re-cut instead of being refused.
    possible: Vec<SliceConfig>,
}

/// The cgroups `gpuslice run` commands are put in, and what each pool asks.
#[derive(Clone, Debug, Default)]
pub struct Limits {
    /// The node's name (groups are `gpuslice/<node>/<slice>`).
    pub node: String,
    /// The node's I/O controller, when it has one.
    pub io: Option<crate::protections::iolimit::Cgroups>,
    /// Its cpu, cpuset and memory controllers, when it has them.
    pub host: Option<crate::protections::hostlimit::HostCgroups>,
    /// Each GPU's I/O limit per slice (bytes/s, from its pool's `io.bandwidthPerSlice`).
    pub bandwidth: BTreeMap<u32, u64>,
    /// Each GPU's pool's CheckpointPolicy, as a workload there whose policy names none is told.
    pub checkpointing: BTreeMap<u32, Checkpointing>,
}

impl Board {
    /// Grants free slices to waiters in order of arrival, each the smallest free slice that fits.
    fn assign(&mut self) {
        let mut waiting = VecDeque::new();
        while let Some((conn, need, policy)) = self.queue.pop_front() {
            let taken: Vec<&str> = self
                .claims
                .values()
                .chain(&self.pinned)
                .chain(&self.preparing)
                .map(|c| c.slice.as_str())
                .collect();
            let best = self
                .slices
                .iter()
                .filter(|s| {
                    !taken.contains(&s.id.as_str())
                        && !self.closed.contains(&s.id)
                        && need.fits(s, &self.pools)
                })
                .min_by_key(|s| (s.memory_bytes, s.compute_percent, s.id.clone()))
                .map(|s| s.id.clone());
            match best {
                Some(slice) => {
                    self.claims.insert(
                        conn,
                        Claim {
                            slice,
                            client: 0,
                            workload: None,
                            policy,
                            resource_claim: None,
                            pods: Vec::new(),
                            pod_names: Vec::new(),
                        },
                    );
                }
                None if !self
                    .slices
                    .iter()
                    .chain(&self.possible)
                    .any(|s| need.fits(s, &self.pools)) =>
                {
                    if let Some(id) = &need.only {
                        self.refused.insert(
                            conn,
                            format!("slice {id} is not on this node, or does not fit the request"),
                        );
                        continue;
                    }
                    let of_pool = need
                        .pool
                        .as_ref()
                        .map(|p| format!(" of pool {p}"))
                        .unwrap_or_default();
                    self.refused.insert(
                        conn,
                        format!(
                            "no slice{of_pool} on this node has {} of memory and {}% compute",
                            gpuslice_api::quantity::format_bytes(need.memory),
                            need.compute
                        ),
                    );
                }
                None => waiting.push_back((conn, need, policy)),
            }
        }
        self.queue = waiting;
    }
}

/// The node's claims, shared by the agent's passes and the socket's connections.
#[derive(Default)]
pub struct Claims {
    board: Mutex<Board>,
    changed: Condvar,
}

impl Claims {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slices the node has now, the pool of each GPU, and what each policy needs; waiters
    /// may now fit.
    pub fn update(
        &self,
        slices: Vec<SliceConfig>,
        pools: BTreeMap<u32, String>,
        policies: BTreeMap<String, Need>,
        pinned: Vec<Claim>,
    ) {
        let mut board = self.lock();
        board.slices = slices;
        board.pools = pools;
        board.policies = policies;
        board.preparing.retain(|p| {
            !pinned
                .iter()
                .any(|c| c.resource_claim == p.resource_claim && c.slice == p.slice)
        });
        board.pinned = pinned;
        board.assign();
        self.changed.notify_all();
    }

    /// Pins `slices` for the ResourceClaim `resource_claim` (`namespace/name`) being prepared,
    /// unless a `gpuslice run` holds one of them: the scheduler may allocate a slice before the
    /// agent's taint on it is published, and a slice has one holder. Until a pass reads the
    /// prepared claim from the state directory (or [`unpin`](Self::unpin) after a failure), the
    /// pin keeps `want`s off these slices. Returns the holder's description when refused.
    pub fn pin(&self, slices: &[String], resource_claim: &str) -> Result<(), String> {
        let mut board = self.lock();
        if let Some(held) = board
            .claims
            .values()
            .find(|c| c.resource_claim.is_none() && slices.contains(&c.slice))
        {
            return Err(format!(
                "slice {} is held by `gpuslice run` (pid {}) on this node",
                held.slice,
                held.workload.unwrap_or(held.client)
            ));
        }
        for slice in slices {
            let pinned =
                board.pinned.iter().chain(&board.preparing).any(|c| {
                    c.slice == *slice && c.resource_claim.as_deref() == Some(resource_claim)
                });
            if !pinned {
                board.preparing.push(Claim {
                    slice: slice.clone(),
                    client: 0,
                    workload: None,
                    policy: None,
                    resource_claim: Some(resource_claim.to_string()),
                    pods: Vec::new(),
                    pod_names: Vec::new(),
                });
            }
        }
        Ok(())
    }

    /// Drops the pins of a ResourceClaim whose preparation failed; waiters may now fit.
    pub fn unpin(&self, resource_claim: &str) {
        let mut board = self.lock();
        board
            .preparing
            .retain(|c| c.resource_claim.as_deref() != Some(resource_claim));
        board.assign();
        self.changed.notify_all();
    }

    /// Closes these slices to new claims (and opens all others); waiters may now fit.
    pub fn set_closed(&self, closed: std::collections::BTreeSet<String>) {
        let mut board = self.lock();
        if board.closed != closed {
            board.closed = closed;
            board.assign();
            self.changed.notify_all();
        }
    }

    /// The cgroups and limits `gpuslice run` commands granted from now on are held to.
    pub fn set_limits(&self, limits: Limits) {
        self.lock().limits = limits;
    }

    /// Puts a `gpuslice run` process (and so the command it is about to start) in its slice's
    /// cgroups: the I/O limit of the slice's pool, the host CPU and memory of its policy.
    fn confine(&self, client: u32, slice: &str, host: crate::protections::hostlimit::HostLimit) {
        let (limits, bandwidth, others) = {
            let board = self.lock();
            let gpu = board.slices.iter().find(|s| s.id == slice).map(|s| s.gpu);
            let bandwidth = gpu.and_then(|g| board.limits.bandwidth.get(&g).copied());
            let others: Vec<String> = board.claims.values().map(|c| c.slice.clone()).collect();
            (board.limits.clone(), bandwidth, others)
        };
        if let Some(bandwidth) = bandwidth {
            let applied = limits.io.as_ref().map(|io| {
                let group = io.run_group(&limits.node, slice)?;
                io.limit(&group, bandwidth)?;
                io.enter(&group, client)
            });
            match applied {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::warn!("slice {slice}: pid {client}'s I/O limit: {e}"),
                None => tracing::warn!("slice {slice}: no I/O controller for pid {client}'s limit"),
            }
        }
        if host != crate::protections::hostlimit::HostLimit::default() {
            let applied = limits
                .host
                .as_ref()
                .map(|cg| cg.confine(&limits.node, slice, client, host, &others));
            match applied {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::warn!("slice {slice}: pid {client}'s CPU and memory: {e}"),
                None => tracing::warn!(
                    "slice {slice}: no cpu, cpuset and memory controllers for pid {client}'s limits"
                ),
            }
        }
    }

    /// The slices the elastic sets in force could cut (see [`Board::possible`]).
    pub fn set_possible(&self, possible: Vec<SliceConfig>) {
        let mut board = self.lock();
        board.possible = possible;
    }

    /// Requests waiting in line per policy they named (those naming none are not counted).
    pub fn waiting_by_policy(&self) -> BTreeMap<String, u32> {
        let board = self.lock();
        let mut out: BTreeMap<String, u32> = BTreeMap::new();
        for policy in board.queue.iter().filter_map(|(_, _, p)| p.as_ref()) {
            *out.entry(policy.clone()).or_default() += 1;
        }
        out
    }

    /// The node's slices as the last pass left them.
    pub fn slices(&self) -> Vec<SliceConfig> {
        self.lock().slices.clone()
    }

    /// Every claim held now, prepared ResourceClaims included.
    pub fn held(&self) -> Vec<Claim> {
        let board = self.lock();
        let mut claims: Vec<Claim> = board
            .claims
            .values()
            .chain(&board.pinned)
            .cloned()
            .collect();
        claims.sort_by(|a, b| a.slice.cmp(&b.slice));
        claims
    }

    /// Serves one claim (the connection's first request was `want`) until its client hangs up:
    /// a place in line, then the slice, held while the connection stays open.
    pub fn serve(
        &self,
        stream: UnixStream,
        mut reader: BufReader<UnixStream>,
        want: Want,
        client: u32,
        state: &StateDir,
    ) -> std::io::Result<()> {
        let mut writer = stream.try_clone()?;
        let mut send = |reply: &Reply| writer.write_all(&socket::line(reply));
        let conn = {
            let mut board = self.lock();
            let need = match resolve(&want, &board.policies) {
                Ok(need) => need,
                Err(reason) => {
                    drop(board);
                    return send(&Reply::Refused { reason });
                }
            };
            board.next += 1;
            let conn = board.next;
            board.queue.push_back((conn, need, want.policy.clone()));
            board.assign();
            conn
        };
        // Wait in line, telling the client where it stands; a client that hangs up leaves.
        let mut shown = 0;
        let granted = loop {
            let mut board = self.lock();
            if let Some(claim) = board.claims.get_mut(&conn) {
                claim.client = client;
                break claim.slice.clone();
            }
            if let Some(reason) = board.refused.remove(&conn) {
                drop(board);
                return send(&Reply::Refused { reason });
            }
            let position = board
                .queue
                .iter()
                .position(|(c, _, _)| *c == conn)
                .unwrap_or(0)
                + 1;
            if want.no_wait {
                board.queue.retain(|(c, _, _)| *c != conn);
                drop(board);
                return send(&Reply::Refused {
                    reason: format!("no free slice fits ({} ahead in line)", position - 1),
                });
            }
            if position != shown {
                shown = position;
                drop(board);
                if send(&Reply::Queued { position }).is_err() {
                    return self.leave(conn);
                }
                continue;
            }
            let (board, _) = self
                .changed
                .wait_timeout(board, HANGUP_CHECK)
                .unwrap_or_else(|p| p.into_inner());
            drop(board);
            if hung_up(&stream) {
                return self.leave(conn);
            }
        };
        let config = state.slice_config(&granted);
        // A workload claiming its slice again keeps its memory high-water mark.
        if want.slice.is_none() {
            crate::gpu::slices::new_workload(state, &granted);
        }
        let host = want
            .policy
            .as_ref()
            .and_then(|p| self.lock().policies.get(p).map(|n| n.host))
            .unwrap_or_default();
        self.confine(client, &granted, host);
        let slice = crate::gpu::slices::read_config(state, &granted).ok();
        let checkpoint = self.checkpointing(&want, slice.as_ref().map(|s| s.gpu));
        let mps_share = slice
            .as_ref()
            .filter(|s| s.kind == SliceKind::Mps)
            .map(|s| self.mps_share(s, want.policy.as_deref()));
        if send(&Reply::Granted {
            slice: granted,
            config,
            device_uuid: slice.map(|c| c.device_uuid).unwrap_or_default(),
            checkpoint,
            mps_share,
        })
        .is_ok()
        {
            // Held until the client hangs up.
            let mut line = String::new();
            while gpuslice_contract::socket::read_line(&mut reader, &mut line).unwrap_or(0) > 0 {
                if let Ok(Request::Running { pid }) = serde_json::from_str(&line)
                    && parent_of(pid) == Some(client)
                    && let Some(claim) = self.lock().claims.get_mut(&conn)
                {
                    claim.workload = Some(pid);
                }
                line.clear();
            }
        }
        self.leave(conn)
    }

    /// The share of the SMs a workload of `policy` gets on MPS slice `slice`: the policy's
    /// compute limit where lower than the slice's.
    pub fn mps_share(&self, slice: &SliceConfig, policy: Option<&str>) -> u32 {
        let limit = policy
            .and_then(|p| self.lock().policies.get(p).map(|n| n.compute))
            .filter(|l| *l > 0);
        limit.map_or(slice.compute_percent, |l| l.min(slice.compute_percent))
    }

    /// What a workload granted a slice of GPU `gpu` for `want` is told of its CheckpointPolicy:
    /// its policy's own, else the GPU's pool's (the one that drains it).
    fn checkpointing(&self, want: &Want, gpu: Option<u32>) -> Option<Checkpointing> {
        let board = self.lock();
        let own = want
            .policy
            .as_ref()
            .and_then(|p| board.policies.get(p)?.checkpoint.clone());
        own.or_else(|| board.limits.checkpointing.get(&gpu?).cloned())
    }

    fn leave(&self, conn: u64) -> std::io::Result<()> {
        let mut board = self.lock();
        board.claims.remove(&conn);
        board.queue.retain(|(c, _, _)| *c != conn);
        board.assign();
        self.changed.notify_all();
        Ok(())
    }
}

fn hung_up(stream: &UnixStream) -> bool {
    use rustix::net::{RecvFlags, recv};
    let mut byte = [0u8; 1];
    matches!(
        recv(stream, &mut byte[..], RecvFlags::PEEK | RecvFlags::DONTWAIT),
        Ok((0, _))
    )
}

fn resolve(want: &Want, policies: &BTreeMap<String, Need>) -> Result<Need, String> {
    let mut need = match &want.policy {
        Some(name) => policies
            .get(name)
            .cloned()
            .ok_or_else(|| format!("GpuSlicePolicy {name:?} is not in this node's source"))?,
        None => Need::default(),
    };
    if need.count > 1 {
        return Err(format!(
            "GpuSlicePolicy {:?} gives each workload {} slices (spec.count), and a command run here gets one: run it in a cluster, where a pod gets all of them, or use a policy of count 1",
            want.policy.as_deref().unwrap_or_default(),
            need.count
        ));
    }
    if let Some(m) = want.memory_bytes {
        need.memory = need.memory.max(m);
    }
    if let Some(c) = want.compute_percent {
        need.compute = need.compute.max(c);
    }
    need.only = want.slice.clone();
    Ok(need)
}

/// What a workload drained with CheckpointPolicy `spec` is told.
pub fn checkpointing(spec: &gpuslice_api::CheckpointPolicySpec) -> Checkpointing {
    Checkpointing {
        signal: spec.signal.name().to_string(),
        interval_seconds: spec
            .interval
            .map(|i| std::time::Duration::from(i).as_secs()),
    }
}

/// What each policy of a config needs: its memory plus its pool's headroom, its compute limit.
pub fn needs(config: &Config) -> BTreeMap<String, Need> {
    config
        .policies
        .iter()
        .map(|(name, spec)| {
            let headroom = config
                .pools
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(spec.pool.as_str()))
                .and_then(|p| p.spec.memory_headroom.as_ref())
                .and_then(|h| gpuslice_api::bytes_of(&h.0).ok())
                .unwrap_or(0);
            let memory = gpuslice_api::bytes_of(&spec.memory.0).unwrap_or(u64::MAX);
            let compute = spec.compute.as_ref().map_or(0, |c| c.limit);
            let guarantee = spec.compute.as_ref().and_then(|c| c.guarantee).unwrap_or(0);
            let host = crate::protections::hostlimit::HostLimit {
                millicores: spec
                    .host
                    .as_ref()
                    .and_then(|h| gpuslice_api::millicores_of(&h.cpu.as_ref()?.0).ok()),
                memory_bytes: spec
                    .host
                    .as_ref()
                    .and_then(|h| gpuslice_api::bytes_of(&h.memory.as_ref()?.0).ok()),
            };
            (
                name.clone(),
                Need {
                    memory: memory.saturating_add(headroom),
                    compute,
                    guarantee,
                    pool: Some(spec.pool.clone()),
                    host,
                    only: None,
                    count: spec.count,
                    checkpoint: spec
                        .checkpoint_policy
                        .as_ref()
                        .and_then(|c| config.checkpoints.get(c))
                        .map(checkpointing),
                },
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuslice_contract::SliceKind;

    fn slice(id: &str, gib: u64, compute: u32) -> SliceConfig {
        SliceConfig {
            id: id.into(),
            kind: SliceKind::Software,
            gpu: 0,
            device_minor: None,
            device_uuid: "GPU-x".into(),
            memory_bytes: gib << 30,
            compute_percent: compute,
        }
    }

    #[test]
    fn waiters_get_the_smallest_fitting_slice_in_order_of_arrival() {
        let mut board = Board {
            slices: vec![slice("big", 40, 50), slice("small", 10, 25)],
            ..Board::default()
        };
        let need = |gib: u64| Need {
            memory: gib << 30,
            compute: 10,
            ..Need::default()
        };
        board.queue = VecDeque::from([
            (1, need(5), None),
            (2, need(5), None),
            (3, need(20), None),
            (4, need(80), None),
        ]);
        board.assign();
        assert_eq!(board.claims[&1].slice, "small", "the smallest that fits");
        assert_eq!(board.claims[&2].slice, "big");
        assert_eq!(
            board.queue.iter().map(|(c, _, _)| *c).collect::<Vec<_>>(),
            [3],
            "3 waits"
        );
        assert!(
            board.refused[&4].contains("80 Gi") || board.refused[&4].contains("80Gi"),
            "{}",
            board.refused[&4]
        );
        board.claims.remove(&2);
        board.assign();
        assert_eq!(board.claims[&3].slice, "big", "3 gets the slice 2 left");
    }

    #[test]
    fn a_slice_claimed_again_is_that_slice_only_and_waits_while_another_holds_it() {
        let mut board = Board {
            slices: vec![slice("gpu0-s0", 10, 25), slice("gpu0-s1", 10, 25)],
            ..Board::default()
        };
        let again = |id: &str| Need {
            memory: 5 << 30,
            only: Some(id.into()),
            ..Need::default()
        };
        board.queue = VecDeque::from([
            (1, Need::default(), None),
            (2, again("gpu0-s0"), None),
            (3, again("gpu9-s0"), None),
        ]);
        board.assign();
        assert_eq!(board.claims[&1].slice, "gpu0-s0");
        assert!(!board.claims.contains_key(&2), "not gpu0-s1 instead");
        assert_eq!(
            board.queue.iter().map(|(c, _, _)| *c).collect::<Vec<_>>(),
            [2]
        );
        assert!(
            board.refused[&3].contains("slice gpu9-s0 is not on this node"),
            "{}",
            board.refused[&3]
        );
        board.claims.remove(&1);
        board.assign();
        assert_eq!(board.claims[&2].slice, "gpu0-s0");
    }

    #[test]
    fn a_closed_slice_is_given_to_nobody_new() {
        let mut board = Board {
            slices: vec![slice("small", 10, 25), slice("big", 40, 50)],
            closed: std::collections::BTreeSet::from(["small".to_string()]),
            ..Board::default()
        };
        board.queue = VecDeque::from([(
            1,
            Need {
                memory: 5 << 30,
                ..Need::default()
            },
            None,
        )]);
        board.assign();
        assert_eq!(
            board.claims[&1].slice, "big",
            "the quarantined one is skipped"
        );
    }

    #[test]
    fn a_policy_takes_only_slices_of_its_pool() {
        let mut other = slice("other", 40, 50);
        other.gpu = 1;
        let mut board = Board {
            slices: vec![slice("mine", 10, 25), other],
            pools: BTreeMap::from([(0, "lab".to_string()), (1, "prod".to_string())]),
            ..Board::default()
        };
        let need = |gib: u64| Need {
            memory: gib << 30,
            pool: Some("lab".into()),
            ..Need::default()
        };
        board.queue = VecDeque::from([(1, need(5), None), (2, need(5), None), (3, need(20), None)]);
        board.assign();
        assert_eq!(board.claims[&1].slice, "mine");
        assert!(
            !board.claims.contains_key(&2),
            "prod's free slice is not lab's"
        );
        assert_eq!(
            board.queue.iter().map(|(c, _, _)| *c).collect::<Vec<_>>(),
            [2]
        );
        assert!(
            board.refused[&3].contains("of pool lab"),
            "{}",
            board.refused[&3]
        );
    }
}
