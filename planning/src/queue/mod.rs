//! A pool's admission queue (pure): in which order its waiting pods go, which of them a free
//! slice fits now, and onto which node each goes.
//!
//! Order, by the pool's `scheduling.policy`:
//! - `Fifo`: arrival.
//! - `Priority`: the policy's priority, then arrival.
//! - `Fair`: the namespace furthest below its weighted share first — slices it holds (and was
//!   given earlier in this pass) per unit of weight, then its decayed usage per unit of weight —
//!   then arrival within the namespace.
//! - `PriorityFair` (the default): priority first, fair share among equal priorities.
//!
//! A pod is admitted when a free device fits it; pods behind one that fits nothing may still be
//! admitted onto devices that one could not use (it fits none of the free devices, so nothing
//! is taken from it; a device freed later is offered to it first).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::SchedulingPolicy;

mod place;
pub mod replay;

pub use place::{EnginePlacer, Nodes, Placer, Room};

/// The number a priority name stands for: `low` 0, `normal` 100, `high` 1000, or the value of
/// the PriorityClass of that name in `classes` (one that does not exist counts as `normal`).
pub fn priority_value(name: &str, classes: &BTreeMap<String, i64>) -> i64 {
    match name {
        "low" => 0,
        "normal" => 100,
        "high" => 1000,
        class => classes.get(class).copied().unwrap_or(100),
    }
}

/// The priority of `policy` (declared `declared`) in `pool` at `at`: the open window's, where it
/// names the policy, else the policy's own.
pub fn priority_in_force(
    pool: &gpuslice_api::GpuPool,
    policy: &str,
    declared: &str,
    at: DateTime<Utc>,
    classes: &BTreeMap<String, i64>,
) -> i64 {
    let (window, _) = crate::cluster::pool_timing(pool, at);
    let name = window
        .and_then(|w| pool.spec.windows[w].priorities.get(policy))
        .map_or(declared, String::as_str);
    priority_value(name, classes)
}

/// A pod waiting at the gate.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    pub namespace: String,
    pub name: String,
    /// The GpuSlicePolicy it names.
    pub policy: String,
    /// Larger goes first.
    pub priority: i64,
    pub created: DateTime<Utc>,
    /// When it would end if admitted now (its declared expected run time), if it declares one.
    pub runs_until: Option<DateTime<Utc>>,
    /// How many slices it takes, all on one node (its policy's `count`).
    pub count: u32,
    /// Its slices must share an NVLink domain (its policy's `topology: nvlink`).
    pub nvlink: bool,
    /// The CPU (millicores) and memory (MiB) it requests: its node must have them free.
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

impl Waiting {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether `d` stays as it is for as long as the pod means to run on it: a device whose GPU
    /// a window change re-cuts before then is no place for it.
    pub fn outlived_by(&self, d: &FreeDevice) -> bool {
        match (self.runs_until, d.recut_at) {
            (Some(until), Some(recut)) => until <= recut,
            _ => true,
        }
    }
}

/// A namespace's standing in a pool.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Share {
    /// Its weight (default 1).
    pub weight: f64,
    /// Slices its pods hold now.
    pub holding: u32,
    /// Slice-seconds used, decayed by the pool's half-life.
    pub usage: f64,
}

/// A free device (slice) of the pool.
#[derive(Clone, Debug, PartialEq)]
pub struct FreeDevice {
    pub node: String,
    pub gpu: u32,
    pub device: String,
    pub memory_bytes: u64,
    pub compute: u32,
    /// The thousandths of its GPU it is: 1000 / the slices on it for a software slice, its
    /// memory over the GPU's for a MIG instance, 1000 for a whole GPU.
    pub share: u32,
    /// When a window change next re-cuts its GPU, if one does.
    pub recut_at: Option<DateTime<Utc>>,
    /// The NVLink domain of its GPU (device attribute `nvlinkDomain`); none without NVLink.
    pub nvlink_domain: Option<String>,
}

/// What a policy's pod needs of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    pub memory_bytes: u64,
    pub compute: u32,
}

impl Need {
    pub fn fits(&self, d: &FreeDevice) -> bool {
        d.memory_bytes >= self.memory_bytes && d.compute >= self.compute
    }
}

/// How fragmented a pool's free slices are, in percent of their memory: the FGD paper's
/// expected fragment (the measure the placement engine minimises, [`crate::placement::fragment`]) on
/// the pool's discrete slices. For each policy of the pool, weighted by its share of demand,
/// the free memory it cannot use (free slices too small for it or short of its compute limit);
/// 0 with no free slice or no policy.
pub fn fragmentation(free: &[FreeDevice], mix: &[(Need, f64)]) -> f64 {
    let total: u64 = free.iter().map(|d| d.memory_bytes).sum();
    let weights: f64 = mix.iter().map(|(_, w)| w).sum();
    if total == 0 || weights <= 0.0 {
        return 0.0;
    }
    let expected: f64 = mix
        .iter()
        .map(|(need, weight)| {
            let unusable: u64 = free
                .iter()
                .filter(|d| !need.fits(d))
                .map(|d| d.memory_bytes)
                .sum();
            weight * unusable as f64
        })
        .sum();
    100.0 * expected / weights / total as f64
}

/// Why a pod still waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// No free slice of the pool fits its policy.
    NoSliceFits,
    /// Free slices fit, but a window change re-cuts each of them before its expected run time
    /// ends.
    WindowChangeAhead,
    /// Its policy is unknown or names no pool.
    UnknownPolicy,
    /// Free slices fit, but no node that has them has the CPU or memory the pod requests free.
    NoRoom,
}

/// What the queue decided in one pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Pods (`namespace/name`) to admit, each with its node.
    pub admit: Vec<(String, String)>,
    /// Pods that wait: their 1-based place in the queue, and why.
    pub wait: Vec<(String, usize, Reason)>,
    /// The free devices left after the admissions.
    pub left: Vec<FreeDevice>,
}

/// Orders the waiting pods (indices into `pods`) as `policy` says.
pub fn order(
    policy: SchedulingPolicy,
    pods: &[Waiting],
    shares: &BTreeMap<String, Share>,
) -> Vec<usize> {
    let mut by_arrival: Vec<usize> = (0..pods.len()).collect();
    by_arrival
        .sort_by(|&a, &b| (pods[a].created, pods[a].key()).cmp(&(pods[b].created, pods[b].key())));
    match policy {
        SchedulingPolicy::Fifo => by_arrival,
        SchedulingPolicy::Priority => {
            by_arrival.sort_by_key(|&i| std::cmp::Reverse(pods[i].priority));
            by_arrival
        }
        SchedulingPolicy::Fair => fair(&by_arrival, pods, shares),
        SchedulingPolicy::PriorityFair => {
            let mut levels: BTreeMap<std::cmp::Reverse<i64>, Vec<usize>> = BTreeMap::new();
            for i in by_arrival {
                levels
                    .entry(std::cmp::Reverse(pods[i].priority))
                    .or_default()
                    .push(i);
            }
            levels
                .values()
                .flat_map(|level| fair(level, pods, shares))
                .collect()
        }
    }
}

/// Fair share among `arrivals` (already in arrival order): repeatedly the next pod of the
/// namespace with the least held slices per weight (counting those it is given in this order),
/// then the least decayed usage per weight.
fn fair(arrivals: &[usize], pods: &[Waiting], shares: &BTreeMap<String, Share>) -> Vec<usize> {
    let mut queues: BTreeMap<&str, std::collections::VecDeque<usize>> = BTreeMap::new();
    for &i in arrivals {
        queues.entry(&pods[i].namespace).or_default().push_back(i);
    }
    let mut given: BTreeMap<&str, u32> = BTreeMap::new();
    let mut out = Vec::with_capacity(arrivals.len());
    while let Some(namespace) = queues
        .iter()
        .filter(|(_, q)| !q.is_empty())
        .map(|(ns, _)| *ns)
        .min_by(|a, b| {
            let key = |ns: &str| {
                let share = shares.get(ns).cloned().unwrap_or_default();
                let weight = if share.weight > 0.0 {
                    share.weight
                } else {
                    1.0
                };
                let held = f64::from(share.holding + given.get(ns).copied().unwrap_or(0));
                (held / weight, share.usage / weight)
            };
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        })
    {
        let i = queues
            .get_mut(namespace)
            .and_then(|q| q.pop_front())
            .expect("a non-empty queue");
        *given.entry(namespace).or_default() += 1;
        out.push(i);
    }
    out
}

/// The devices `pod` could be given, per node: a node counts only with at least `pod.count` of
/// them (on one NVLink domain when the pod needs NVLink; then only such domains' devices).
fn candidates<'a>(
    pod: &Waiting,
    usable: impl Iterator<Item = &'a FreeDevice>,
) -> BTreeMap<String, Vec<FreeDevice>> {
    let count = pod.count.max(1) as usize;
    let mut groups: BTreeMap<(String, Option<String>), Vec<&FreeDevice>> = BTreeMap::new();
    for d in usable {
        if let Some(group) = together_at(pod, d) {
            groups.entry(group).or_default().push(d);
        }
    }
    let mut out: BTreeMap<String, Vec<FreeDevice>> = BTreeMap::new();
    for ((node, _), devices) in groups {
        if devices.len() >= count {
            out.entry(node)
                .or_default()
                .extend(devices.into_iter().cloned());
        }
    }
    out
}

/// The devices the allocator takes for a pod of `count` slices (`nvlink`: on one domain) on its
/// node's `candidates`: the `count` smallest of the group (NVLink domain) with the fewest that
/// still holds them, so larger sets stay whole.
fn taken_on(count: u32, nvlink: bool, candidates: &[&FreeDevice]) -> Vec<FreeDevice> {
    let count = count.max(1) as usize;
    let mut groups: BTreeMap<Option<&str>, Vec<&FreeDevice>> = BTreeMap::new();
    for &d in candidates {
        let domain = if nvlink && count > 1 {
            // Devices of no NVLink domain never serve such a pod (as in `together_at`).
            let Some(domain) = d.nvlink_domain.as_deref() else {
                continue;
            };
            Some(domain)
        } else {
            None
        };
        groups.entry(domain).or_default().push(d);
    }
    let Some(mut group) = groups
        .into_values()
        .filter(|g| g.len() >= count)
        .min_by_key(Vec::len)
    else {
        return Vec::new();
    };
    group.sort_by_key(|d| (d.memory_bytes, d.compute, d.device.clone()));
    group.into_iter().take(count).cloned().collect()
}

/// One pass of the queue: the pods in `order`, each admitted onto a node where all of its
/// `count` slices are free and fit its policy's need and its CPU and memory requests fit the
/// node's room (those devices are then taken, and that room), or left waiting with its place
/// and reason; never some of its slices.
pub fn decide(
    pods: &[Waiting],
    order: &[usize],
    needs: &BTreeMap<String, Need>,
    free: &[FreeDevice],
    nodes: &mut Nodes,
    placer: &mut dyn Placer,
) -> Decision {
    let mut free: Vec<FreeDevice> = free.to_vec();
    let mut decision = Decision::default();
    let mut place = 0;
    for &i in order {
        let pod = &pods[i];
        match admit(pod, needs.get(&pod.policy), &mut free, nodes, placer) {
            Ok(node) => decision.admit.push((pod.key(), node)),
            Err(reason) => {
                place += 1;
                decision.wait.push((pod.key(), place, reason));
            }
        }
    }
    decision.left = free;
    decision
}

/// Admits `pod` (of policy need `need`, none when its policy is unknown) onto the node
/// `placer` picks among those whose `free` devices and room hold it, taking those devices from
/// `free` and its requests from the node's room; or says why it waits.
pub fn admit(
    pod: &Waiting,
    need: Option<&Need>,
    free: &mut Vec<FreeDevice>,
    nodes: &mut Nodes,
    placer: &mut dyn Placer,
) -> Result<String, Reason> {
    let need = need.ok_or(Reason::UnknownPolicy)?;
    let usable = |d: &FreeDevice| need.fits(d) && pod.outlived_by(d);
    let mut candidates = candidates(pod, free.iter().filter(|d| usable(d)));
    let fitting = !candidates.is_empty();
    if fitting {
        placer.arrived(pod, &candidates);
    }
    candidates.retain(|node, _| nodes.fits(node, pod));
    if candidates.is_empty() {
        return Err(if fitting {
            Reason::NoRoom
        } else if candidates_of(pod, free, need) {
            Reason::WindowChangeAhead
        } else {
            Reason::NoSliceFits
        });
    }
    let node = placer.pick(pod, &candidates, free, nodes);
    take(free, &node, usable, pod.count, pod.nvlink);
    if let Some(room) = nodes.rooms.get_mut(&node) {
        room.take(pod);
    }
    Ok(node)
}

/// Removes from `free` the devices a pod of `count` slices (`nvlink`: on one NVLink domain) sent
/// to `node` is allocated, of those `usable` for it: they are spoken for.
pub fn take(
    free: &mut Vec<FreeDevice>,
    node: &str,
    usable: impl Fn(&FreeDevice) -> bool,
    count: u32,
    nvlink: bool,
) {
    let on_node: Vec<&FreeDevice> = free
        .iter()
        .filter(|d| d.node == node && usable(d))
        .collect();
    let taken = taken_on(count, nvlink, &on_node);
    free.retain(|d| !(d.node == node && taken.iter().any(|t| t.device == d.device)));
}

/// Whether some node holds all of the pod's slices when window changes are not counted.
fn candidates_of(pod: &Waiting, free: &[FreeDevice], need: &Need) -> bool {
    !candidates(pod, free.iter().filter(|d| need.fits(d))).is_empty()
}

/// A pod's slice the queue may take back: a candidate victim.
#[derive(Clone, Debug, PartialEq)]
pub struct Running {
    /// Its ResourceClaim (`namespace/name`).
    pub claim: String,
    pub namespace: String,
    /// The device it holds: what taking it frees.
    pub device: FreeDevice,
    /// Its policy's priority (in the window in force).
    pub priority: i64,
    /// Its policy's `preemptible`.
    pub preemptible: bool,
    /// Work a preemption would lose ([`work_lost`]): seconds of GPU work since its last
    /// checkpoint, or since it started.
    pub loss_seconds: f64,
    /// Its CheckpointPolicy's `maxLoss` (seconds): past it, it is taken only when no victim
    /// within its own maxLoss fits.
    pub max_loss_seconds: Option<f64>,
    /// Already being taken back: for which waiting pod (`namespace/name`), and why.
    pub taken_for: Option<(String, String)>,
}

/// Seconds of GPU work a workload did since `from` (its last checkpoint, or its start), at
/// `at`: until it stopped computing (`idle_since`, as its agent reports it), or until now while it
/// computes. What a drain or a preemption loses of it.
pub fn work_lost(from: DateTime<Utc>, idle_since: Option<DateTime<Utc>>, at: DateTime<Utc>) -> f64 {
    let computed_until = idle_since.map_or(at, |idle| idle.min(at));
    (computed_until - from).num_milliseconds().max(0) as f64 / 1000.0
}

impl Running {
    /// Whether taking it now would lose more than its CheckpointPolicy's `maxLoss`.
    fn past_max_loss(&self) -> bool {
        self.max_loss_seconds
            .is_some_and(|most| self.loss_seconds > most)
    }
}

/// A slice to take back, for whom and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preempt {
    pub claim: String,
    pub node: String,
    pub for_pod: String,
    pub reason: String,
}

/// Which running pods to preempt for the pods that wait because no free slice fits them
/// (`waiting`, in queue order): for each, at most one victim, whose device fits it, that is
/// `preemptible`, and either of lower priority (`Priority`, `PriorityFair`) or, at equal
/// priority, of a namespace that would stay at or above the waiting pod's namespace's weighted
/// share after the move (`Fair`, `PriorityFair`); among those, one within its CheckpointPolicy's
/// `maxLoss` before any past it, and the one that loses the least work.
/// Preemptions already under way are kept while their pod still waits (never a second victim
/// for it, never a victim twice). `Fifo` preempts nothing. A pod of several slices takes back
/// the fewest that, with the `free` devices there, make up its count on one node (one NVLink
/// domain when it needs one), or none.
pub fn preempt(
    policy: SchedulingPolicy,
    waiting: &[&Waiting],
    needs: &BTreeMap<String, Need>,
    free: &[FreeDevice],
    running: &[Running],
    shares: &BTreeMap<String, Share>,
) -> Vec<Preempt> {
    let waiting_keys: Vec<String> = waiting.iter().map(|w| w.key()).collect();
    let mut out: Vec<Preempt> = running
        .iter()
        .filter_map(|r| {
            let (for_pod, reason) = r.taken_for.as_ref()?;
            waiting_keys.contains(for_pod).then(|| Preempt {
                claim: r.claim.clone(),
                node: r.device.node.clone(),
                for_pod: for_pod.clone(),
                reason: reason.clone(),
            })
        })
        .collect();
    if policy == SchedulingPolicy::Fifo {
        return out;
    }
    let by_priority = policy != SchedulingPolicy::Fair;
    let by_share = policy != SchedulingPolicy::Priority;
    let mut held: BTreeMap<&str, f64> = shares
        .iter()
        .map(|(ns, s)| (ns.as_str(), f64::from(s.holding)))
        .collect();
    let weight = |ns: &str| {
        shares
            .get(ns)
            .map(|s| s.weight)
            .filter(|w| *w > 0.0)
            .unwrap_or(1.0)
    };
    for pod in waiting {
        if out.iter().any(|p| p.for_pod == pod.key()) {
            continue;
        }
        let Some(need) = needs.get(&pod.policy) else {
            continue;
        };
        // A victim of this pod, and why it may be taken back.
        let eligible = |r: &Running| -> Option<String> {
            if !r.preemptible || r.taken_for.is_some() || !need.fits(&r.device) {
                return None;
            }
            if !pod.outlived_by(&r.device) || out.iter().any(|p| p.claim == r.claim) {
                return None;
            }
            if by_priority && r.priority < pod.priority {
                return Some(format!("priority {} over {}", pod.priority, r.priority));
            }
            let mine = held.get(pod.namespace.as_str()).copied().unwrap_or(0.0);
            let theirs = held.get(r.namespace.as_str()).copied().unwrap_or(0.0);
            let fairer = r.namespace != pod.namespace
                && (mine + 1.0) / weight(&pod.namespace) <= (theirs - 1.0) / weight(&r.namespace);
            (by_share && r.priority == pod.priority && fairer).then(|| {
                format!(
                    "fair share: namespace {} holds {theirs} slices at weight {}, namespace {} {mine} at weight {}",
                    r.namespace,
                    weight(&r.namespace),
                    pod.namespace,
                    weight(&pod.namespace)
                )
            })
        };
        let candidates: Vec<(&Running, String)> = running
            .iter()
            .filter_map(|r| Some((r, eligible(r)?)))
            .collect();
        let victims = if pod.count > 1 {
            several_victims(pod, need, free, candidates)
        } else {
            candidates
                .into_iter()
                .min_by(|(a, _), (b, _)| lighter_first(a, b))
                .into_iter()
                .collect()
        };
        for (victim, reason) in victims {
            *held.entry(victim.namespace.as_str()).or_default() -= 1.0;
            *held.entry(pod.namespace.as_str()).or_default() += 1.0;
            out.push(Preempt {
                claim: victim.claim.clone(),
                node: victim.device.node.clone(),
                for_pod: pod.key(),
                reason,
            });
        }
    }
    out
}

/// Victims within their `maxLoss` before any past it, then the least work lost, the lowest
/// priority, the claim's name.
fn lighter_first(a: &Running, b: &Running) -> std::cmp::Ordering {
    a.past_max_loss()
        .cmp(&b.past_max_loss())
        .then(
            (a.loss_seconds, a.priority)
                .partial_cmp(&(b.loss_seconds, b.priority))
                .unwrap_or(std::cmp::Ordering::Equal),
        )
        .then_with(|| a.claim.cmp(&b.claim))
}

/// Where a pod's slices must be together: its node, and its NVLink domain when it needs one
/// (none for a device off any domain then; a single slice needs no NVLink).
fn together_at(pod: &Waiting, d: &FreeDevice) -> Option<(String, Option<String>)> {
    match (pod.nvlink && pod.count > 1, &d.nvlink_domain) {
        (false, _) => Some((d.node.clone(), None)),
        (true, Some(domain)) => Some((d.node.clone(), Some(domain.clone()))),
        (true, None) => None,
    }
}

/// For a pod of several slices: the fewest `candidates` (lightest first) on one node (one NVLink
/// domain, when it needs one) whose devices, with the free ones there that fit it, make up its
/// count; none when no node can.
fn several_victims<'r>(
    pod: &Waiting,
    need: &Need,
    free: &[FreeDevice],
    mut candidates: Vec<(&'r Running, String)>,
) -> Vec<(&'r Running, String)> {
    let count = pod.count as usize;
    let mut free_at: BTreeMap<(String, Option<String>), usize> = BTreeMap::new();
    for d in free.iter().filter(|d| need.fits(d) && pod.outlived_by(d)) {
        if let Some(group) = together_at(pod, d) {
            *free_at.entry(group).or_default() += 1;
        }
    }
    candidates.sort_by(|(a, _), (b, _)| lighter_first(a, b));
    let groups: std::collections::BTreeSet<(String, Option<String>)> = candidates
        .iter()
        .filter_map(|(r, _)| together_at(pod, &r.device))
        .collect();
    let mut best: Option<Vec<(&'r Running, String)>> = None;
    for group in groups {
        let in_group = |r: &Running| together_at(pod, &r.device).as_ref() == Some(&group);
        let mut have = free_at.get(&group).copied().unwrap_or(0);
        let mut chosen: Vec<(&'r Running, String)> = Vec::new();
        for (r, reason) in &candidates {
            if have >= count {
                break;
            }
            if !in_group(r) || chosen.iter().any(|(c, _)| c.claim == r.claim) {
                continue;
            }
            // Taking a claim back frees every device it holds there.
            have += candidates
                .iter()
                .filter(|(o, _)| o.claim == r.claim && in_group(o))
                .count();
            chosen.push((r, reason.clone()));
        }
        if have >= count && best.as_ref().is_none_or(|b| chosen.len() < b.len()) {
            best = Some(chosen);
        }
    }
    best.unwrap_or_default()
}

/// A namespace's usage after `seconds` more, holding `slices`: the old usage decayed by the
/// half-life, plus what was used since.
pub fn decay(usage: f64, slices: u32, seconds: f64, half_life_seconds: f64) -> f64 {
    let factor = if half_life_seconds > 0.0 {
        0.5f64.powf(seconds / half_life_seconds)
    } else {
        0.0
    };
    usage * factor + f64::from(slices) * seconds
}

#[cfg(test)]
mod tests;
