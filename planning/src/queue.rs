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

use crate::placement::{self, Cluster, Gpu, GpuAsk, Request, WHOLE};

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
    /// Software slices on its GPU (0 for a MIG instance or a whole GPU).
    pub slices_on_gpu: u32,
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
/// expected fragment (the measure the placement engine minimises, [`placement::fragment`]) on
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

/// Picks the node for a pod among the nodes with a free device that fits it.
pub trait Placer {
    /// `candidates`: per node, the free devices that fit, all of one policy's need.
    fn pick(&mut self, candidates: &BTreeMap<String, Vec<FreeDevice>>) -> String;
}

/// Our placement engine's policy (`placement::policies::Mix`, the one that beats FGD) choosing
/// among the candidate nodes, each GPU seen as its free share (free fitting slices over the
/// slices on it); for MIG instances and whole GPUs (no shares), the node with the fewest free
/// fitting devices, so that whole nodes stay free.
pub struct EnginePlacer {
    policy: placement::policies::Mix,
}

impl Default for EnginePlacer {
    fn default() -> Self {
        EnginePlacer {
            policy: placement::policies::Mix::new(512),
        }
    }
}

impl Placer for EnginePlacer {
    fn pick(&mut self, candidates: &BTreeMap<String, Vec<FreeDevice>>) -> String {
        let per_gpu = candidates
            .values()
            .flatten()
            .map(|d| d.slices_on_gpu)
            .max()
            .unwrap_or(0);
        let shared = per_gpu > 0
            && candidates
                .values()
                .flatten()
                .all(|d| d.slices_on_gpu == per_gpu);
        if shared {
            let names: Vec<&String> = candidates.keys().collect();
            let nodes: Vec<placement::Node> = candidates
                .iter()
                .map(|(name, devices)| {
                    let mut free: BTreeMap<u32, u32> = BTreeMap::new();
                    for d in devices {
                        *free.entry(d.gpu).or_default() += 1;
                    }
                    placement::Node {
                        name: name.clone(),
                        model: String::new(),
                        cpu_total: u64::MAX / 4,
                        memory_total: u64::MAX / 4,
                        cpu_free: u64::MAX / 4,
                        memory_free: u64::MAX / 4,
                        gpus: free
                            .values()
                            .map(|n| Gpu::Shared {
                                free: WHOLE * n.min(&per_gpu) / per_gpu,
                            })
                            .collect(),
                    }
                })
                .collect();
            let request = Request {
                cpu_milli: 0,
                memory_mib: 0,
                gpu: GpuAsk::Share(WHOLE / per_gpu),
                models: Vec::new(),
            };
            let cluster = Cluster::new(nodes);
            if let Ok(choice) = cluster.choose(&request, &mut self.policy) {
                return names[choice.node].clone();
            }
        }
        candidates
            .iter()
            .min_by_key(|(name, devices)| (devices.len(), (*name).clone()))
            .map(|(name, _)| name.clone())
            .unwrap_or_default()
    }
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
        let domain = if nvlink {
            d.nvlink_domain.as_deref()
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
/// `count` slices are free and fit its policy's need (those devices are then taken), or left
/// waiting with its place and reason; never some of its slices.
pub fn decide(
    pods: &[Waiting],
    order: &[usize],
    needs: &BTreeMap<String, Need>,
    free: &[FreeDevice],
    placer: &mut dyn Placer,
) -> Decision {
    let mut free: Vec<FreeDevice> = free.to_vec();
    let mut decision = Decision::default();
    let mut place = 0;
    for &i in order {
        let pod = &pods[i];
        let Some(need) = needs.get(&pod.policy) else {
            place += 1;
            decision
                .wait
                .push((pod.key(), place, Reason::UnknownPolicy));
            continue;
        };
        let candidates = candidates(
            pod,
            free.iter().filter(|d| need.fits(d) && pod.outlived_by(d)),
        );
        if candidates.is_empty() {
            place += 1;
            let reason = if candidates_of(pod, &free, need) {
                Reason::WindowChangeAhead
            } else {
                Reason::NoSliceFits
            };
            decision.wait.push((pod.key(), place, reason));
            continue;
        }
        let node = placer.pick(&candidates);
        take(
            &mut free,
            &node,
            |d| need.fits(d) && pod.outlived_by(d),
            pod.count,
            pod.nvlink,
        );
        decision.admit.push((pod.key(), node));
    }
    decision.left = free;
    decision
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
mod tests {
    use super::*;

    fn at(second: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + second, 0).unwrap()
    }

    fn pod(namespace: &str, name: &str, priority: i64, second: i64) -> Waiting {
        Waiting {
            namespace: namespace.into(),
            name: name.into(),
            policy: "notebook".into(),
            priority,
            created: at(second),
            runs_until: None,
            count: 1,
            nvlink: false,
        }
    }

    fn names(pods: &[Waiting], order: &[usize]) -> Vec<String> {
        order.iter().map(|&i| pods[i].name.clone()).collect()
    }

    #[test]
    fn priority_comes_before_arrival_and_fifo_ignores_it() {
        let pods = [pod("a", "early-low", 0, 1), pod("a", "late-high", 100, 2)];
        let shares = BTreeMap::new();
        assert_eq!(
            names(&pods, &order(SchedulingPolicy::Priority, &pods, &shares)),
            ["late-high", "early-low"]
        );
        assert_eq!(
            names(&pods, &order(SchedulingPolicy::Fifo, &pods, &shares)),
            ["early-low", "late-high"]
        );
    }

    #[test]
    fn fair_share_follows_the_weights() {
        // Both namespaces hold nothing; "big" weighs 2, "small" 1: of six places, big gets
        // four and small two, interleaved.
        let pods: Vec<Waiting> = (0..6)
            .map(|i| pod("big", &format!("b{i}"), 0, i))
            .chain((0..6).map(|i| pod("small", &format!("s{i}"), 0, i)))
            .collect();
        let shares = BTreeMap::from([
            (
                "big".to_string(),
                Share {
                    weight: 2.0,
                    ..Default::default()
                },
            ),
            (
                "small".to_string(),
                Share {
                    weight: 1.0,
                    ..Default::default()
                },
            ),
        ]);
        let first_six: Vec<String> = names(&pods, &order(SchedulingPolicy::Fair, &pods, &shares))
            .into_iter()
            .take(6)
            .collect();
        let big = first_six.iter().filter(|n| n.starts_with('b')).count();
        assert_eq!(big, 4, "{first_six:?}");
        // A namespace that holds slices already waits behind one that holds none.
        let shares = BTreeMap::from([
            (
                "big".to_string(),
                Share {
                    weight: 2.0,
                    holding: 10,
                    usage: 0.0,
                },
            ),
            (
                "small".to_string(),
                Share {
                    weight: 1.0,
                    ..Default::default()
                },
            ),
        ]);
        assert!(
            names(&pods, &order(SchedulingPolicy::Fair, &pods, &shares))[..5]
                .iter()
                .all(|n| n.starts_with('s'))
        );
    }

    #[test]
    fn priority_fair_is_fair_within_a_priority_only() {
        let pods = [
            pod("busy", "busy-high", 100, 3),
            pod("idle", "idle-low", 0, 1),
            pod("busy", "busy-low", 0, 2),
        ];
        let shares = BTreeMap::from([(
            "busy".to_string(),
            Share {
                weight: 1.0,
                holding: 5,
                usage: 0.0,
            },
        )]);
        assert_eq!(
            names(
                &pods,
                &order(SchedulingPolicy::PriorityFair, &pods, &shares)
            ),
            ["busy-high", "idle-low", "busy-low"]
        );
    }

    struct First;
    impl Placer for First {
        fn pick(&mut self, candidates: &BTreeMap<String, Vec<FreeDevice>>) -> String {
            candidates.keys().next().unwrap().clone()
        }
    }

    fn device(node: &str, gpu: u32, name: &str, gib: u64) -> FreeDevice {
        FreeDevice {
            node: node.into(),
            gpu,
            device: name.into(),
            memory_bytes: gib << 30,
            compute: 25,
            slices_on_gpu: 4,
            recut_at: None,
            nvlink_domain: None,
        }
    }

    #[test]
    fn a_pod_of_several_slices_gets_all_of_them_on_one_node_or_waits() {
        let gpu = |node: &str, i: u32, domain: Option<&str>| FreeDevice {
            slices_on_gpu: 0,
            nvlink_domain: domain.map(str::to_string),
            ..device(node, i, &format!("{node}-gpu{i}"), 80)
        };
        let needs = BTreeMap::from([(
            "trainer".to_string(),
            Need {
                memory_bytes: 70 << 30,
                compute: 0,
            },
        )]);
        let ask = |name: &str, count: u32, nvlink: bool| Waiting {
            policy: "trainer".into(),
            count,
            nvlink,
            ..pod("ml", name, 0, 0)
        };
        // Three free on one board, two on another: a 4-GPU pod takes none of them.
        let three_and_two: Vec<FreeDevice> = (0..3)
            .map(|i| gpu("hgx-a", i, Some("A")))
            .chain((0..2).map(|i| gpu("hgx-b", i, Some("B"))))
            .collect();
        let pods = [ask("four", 4, false), ask("two", 2, false)];
        let d = decide(
            &pods,
            &[0, 1],
            &needs,
            &three_and_two,
            &mut EnginePlacer::default(),
        );
        assert_eq!(d.wait, [("ml/four".to_string(), 1, Reason::NoSliceFits)]);
        // The 2-GPU pod behind it goes, onto the node where two are free (the fewest that hold
        // it), so the three stay together.
        assert_eq!(d.admit, [("ml/two".to_string(), "hgx-b".to_string())]);

        // A fourth frees up on the first board: the 4-GPU pod takes all four, and nothing is
        // left there for the next one.
        let mut four = three_and_two.clone();
        four.push(gpu("hgx-a", 3, Some("A")));
        let pods = [ask("four", 4, false), ask("another", 4, false)];
        let d = decide(&pods, &[0, 1], &needs, &four, &mut First);
        assert_eq!(d.admit, [("ml/four".to_string(), "hgx-a".to_string())]);
        assert_eq!(d.wait, [("ml/another".to_string(), 1, Reason::NoSliceFits)]);

        // NVLink: a PCIe pair (no domain) and a pair split over two domains never serve; a
        // pair on one domain does.
        let pcie = [gpu("pcie", 0, None), gpu("pcie", 1, None)];
        let split = [
            gpu("two-islands", 0, Some("X")),
            gpu("two-islands", 4, Some("Y")),
        ];
        let pods = [ask("pair", 2, true)];
        for free in [&pcie[..], &split[..]] {
            let d = decide(&pods, &[0], &needs, free, &mut First);
            assert_eq!(d.wait, [("ml/pair".to_string(), 1, Reason::NoSliceFits)]);
        }
        let d = decide(&[ask("pair", 2, false)], &[0], &needs, &pcie, &mut First);
        assert_eq!(d.admit, [("ml/pair".to_string(), "pcie".to_string())]);
        let joined: Vec<FreeDevice> = split
            .iter()
            .cloned()
            .chain([gpu("two-islands", 5, Some("Y"))])
            .collect();
        let d = decide(&pods, &[0], &needs, &joined, &mut First);
        assert_eq!(
            d.admit,
            [("ml/pair".to_string(), "two-islands".to_string())]
        );
    }

    #[test]
    fn a_pod_that_would_outlive_a_slice_is_not_put_on_it() {
        let recut_soon = FreeDevice {
            recut_at: Some(at(1800)),
            ..device("a", 0, "a-0", 20)
        };
        let steady = device("b", 0, "b-0", 20);
        let needs = BTreeMap::from([(
            "notebook".to_string(),
            Need {
                memory_bytes: 8 << 30,
                compute: 0,
            },
        )]);
        let long = Waiting {
            runs_until: Some(at(7200)),
            ..pod("ns", "long", 0, 0)
        };
        let short = Waiting {
            runs_until: Some(at(600)),
            ..pod("ns", "short", 0, 1)
        };
        // Only the slice that is re-cut soon is free: the long job waits, the short one goes.
        let pods = [long.clone(), short.clone()];
        let d = decide(
            &pods,
            &[0, 1],
            &needs,
            std::slice::from_ref(&recut_soon),
            &mut First,
        );
        assert_eq!(d.admit, [("ns/short".to_string(), "a".to_string())]);
        assert_eq!(
            d.wait,
            [("ns/long".to_string(), 1, Reason::WindowChangeAhead)]
        );
        // With a steady slice too, the long job takes that one.
        let d = decide(&pods, &[0, 1], &needs, &[recut_soon, steady], &mut First);
        assert_eq!(
            d.admit,
            [
                ("ns/long".to_string(), "b".to_string()),
                ("ns/short".to_string(), "a".to_string())
            ]
        );
    }

    #[test]
    fn pods_are_admitted_while_devices_fit_and_the_rest_wait_in_order() {
        let mut pods = vec![
            pod("a", "big", 100, 1),
            pod("a", "small-1", 0, 2),
            pod("a", "small-2", 0, 3),
        ];
        pods[0].policy = "training".into();
        let needs = BTreeMap::from([
            (
                "notebook".to_string(),
                Need {
                    memory_bytes: 9 << 30,
                    compute: 0,
                },
            ),
            (
                "training".to_string(),
                Need {
                    memory_bytes: 40 << 30,
                    compute: 0,
                },
            ),
        ]);
        let free = [device("n1", 0, "gpu0-s0", 20)];
        let order = order(SchedulingPolicy::Priority, &pods, &BTreeMap::new());
        let decision = decide(&pods, &order, &needs, &free, &mut First);
        // The big one fits no free device: it waits first in line; a small one takes the
        // device (the big one could not use it); the other small one waits behind it.
        assert_eq!(
            decision.admit,
            [("a/small-1".to_string(), "n1".to_string())]
        );
        assert_eq!(
            decision.wait,
            [
                ("a/big".to_string(), 1, Reason::NoSliceFits),
                ("a/small-2".to_string(), 2, Reason::NoSliceFits)
            ]
        );
    }

    #[test]
    fn fragmentation_is_the_free_memory_the_expected_policies_cannot_use() {
        let free = [
            device("a", 0, "s1", 10),
            device("a", 0, "s2", 10),
            device("b", 0, "s1", 20),
        ];
        let gib = |n: u64| n << 30;
        let big = Need {
            memory_bytes: gib(18),
            compute: 0,
        };
        let small = Need {
            memory_bytes: gib(8),
            compute: 0,
        };
        // 18 GiB cannot use the two 10 GiB slices (half the free memory); 8 GiB uses all.
        assert_eq!(fragmentation(&free, &[(big, 1.0), (small, 1.0)]), 25.0);
        assert_eq!(fragmentation(&free, &[(big, 3.0), (small, 1.0)]), 37.5);
        assert_eq!(fragmentation(&free, &[(small, 1.0)]), 0.0);
        assert_eq!(fragmentation(&[], &[(big, 1.0)]), 0.0);
        assert_eq!(fragmentation(&free, &[]), 0.0);
    }

    #[test]
    fn the_engine_packs_shares_onto_the_fuller_node() {
        // n1 has one free slice left of four on its GPU, n2 a whole free GPU: the engine keeps
        // n2's GPU whole.
        let mut candidates = BTreeMap::new();
        candidates.insert("n1".to_string(), vec![device("n1", 0, "gpu0-s3", 20)]);
        candidates.insert(
            "n2".to_string(),
            (0..4)
                .map(|s| device("n2", 0, &format!("gpu0-s{s}"), 20))
                .collect(),
        );
        assert_eq!(EnginePlacer::default().pick(&candidates), "n1");
    }

    #[test]
    fn usage_decays_by_half_each_half_life() {
        let after = decay(100.0, 0, 3600.0, 3600.0);
        assert!((after - 50.0).abs() < 1e-9);
        assert!((decay(0.0, 2, 10.0, 3600.0) - 20.0).abs() < 1e-9);
    }

    fn running(claim: &str, namespace: &str, priority: i64, loss: f64) -> Running {
        Running {
            claim: format!("{namespace}/{claim}"),
            namespace: namespace.into(),
            device: FreeDevice {
                node: "n".into(),
                gpu: 0,
                device: claim.into(),
                memory_bytes: 20 << 30,
                compute: 100,
                slices_on_gpu: 4,
                recut_at: None,
                nvlink_domain: None,
            },
            priority,
            preemptible: true,
            loss_seconds: loss,
            max_loss_seconds: None,
            taken_for: None,
        }
    }

    fn need() -> BTreeMap<String, Need> {
        [(
            "notebook".to_string(),
            Need {
                memory_bytes: 8 << 30,
                compute: 0,
            },
        )]
        .into()
    }

    #[test]
    fn a_pod_of_several_slices_takes_back_the_fewest_that_complete_it_on_one_node() {
        let on = |node: &str, domain: Option<&str>, claim: &str, loss: f64| Running {
            device: FreeDevice {
                node: node.into(),
                nvlink_domain: domain.map(str::to_string),
                ..running(claim, "ml", 0, loss).device
            },
            ..running(claim, "ml", 0, loss)
        };
        let free_on = |node: &str, domain: Option<&str>, name: &str| FreeDevice {
            node: node.into(),
            device: name.into(),
            nvlink_domain: domain.map(str::to_string),
            ..running(name, "ml", 0, 0.0).device
        };
        let quad = Waiting {
            count: 4,
            ..pod("ml", "quad", 1000, 5)
        };
        // Board a: two free, two running (one cheap, one dear); board b: none free, four cheap.
        let candidates = [
            on("a", None, "a-cheap", 10.0),
            on("a", None, "a-dear", 900.0),
            on("b", None, "b-1", 1.0),
            on("b", None, "b-2", 1.0),
            on("b", None, "b-3", 1.0),
            on("b", None, "b-4", 1.0),
        ];
        let free = [
            free_on("a", None, "a-free-1"),
            free_on("a", None, "a-free-2"),
        ];
        let shares = BTreeMap::new();
        let claims = |got: Vec<Preempt>| -> Vec<String> {
            got.into_iter()
                .map(|p| format!("{} for {}", p.claim, p.for_pod))
                .collect()
        };
        // Two victims beside two free ones beat four cheaper ones: every victim on one node.
        assert_eq!(
            claims(preempt(
                SchedulingPolicy::PriorityFair,
                &[&quad],
                &need(),
                &free,
                &candidates,
                &shares,
            )),
            ["ml/a-cheap for ml/quad", "ml/a-dear for ml/quad"]
        );
        // Nowhere enough: nobody is taken back for nothing.
        let seven = Waiting {
            count: 7,
            ..quad.clone()
        };
        assert!(
            preempt(
                SchedulingPolicy::PriorityFair,
                &[&seven],
                &need(),
                &free,
                &candidates,
                &shares
            )
            .is_empty()
        );
        // NVLink: victims off the pod's domain do not count.
        let nvquad = Waiting {
            nvlink: true,
            ..quad.clone()
        };
        let split = [
            on("c", Some("X"), "c-x", 1.0),
            on("c", Some("Y"), "c-y1", 1.0),
            on("c", Some("Y"), "c-y2", 1.0),
        ];
        let free = [
            free_on("c", Some("X"), "c-x-free"),
            free_on("c", Some("Y"), "c-y-free1"),
            free_on("c", Some("Y"), "c-y-free2"),
        ];
        assert_eq!(
            claims(preempt(
                SchedulingPolicy::PriorityFair,
                &[&nvquad],
                &need(),
                &free,
                &split,
                &shares,
            )),
            ["ml/c-y1 for ml/quad", "ml/c-y2 for ml/quad"]
        );
    }

    #[test]
    fn a_higher_priority_pod_takes_the_slice_that_loses_the_least_work() {
        let urgent = pod("ml", "urgent", 1000, 5);
        let mut pinned = running("pinned", "ml", 0, 1.0);
        pinned.preemptible = false;
        let candidates = [
            pinned,
            running("fresh-checkpoint", "ml", 0, 30.0),
            running("never-checkpointed", "ml", 0, 600.0),
            running("same-priority", "ml", 1000, 0.0),
        ];
        let shares = BTreeMap::new();
        let got = preempt(
            SchedulingPolicy::PriorityFair,
            &[&urgent],
            &need(),
            &[],
            &candidates,
            &shares,
        );
        assert_eq!(
            got.iter().map(|p| p.claim.as_str()).collect::<Vec<_>>(),
            ["ml/fresh-checkpoint"]
        );
        assert_eq!(got[0].for_pod, "ml/urgent");
        // Fifo preempts nobody; nor does anyone for a pod of equal priority in one namespace.
        assert!(
            preempt(
                SchedulingPolicy::Fifo,
                &[&urgent],
                &need(),
                &[],
                &candidates,
                &shares
            )
            .is_empty()
        );
        let peer = pod("ml", "peer", 0, 6);
        assert!(
            preempt(
                SchedulingPolicy::PriorityFair,
                &[&peer],
                &need(),
                &[],
                &candidates,
                &shares
            )
            .is_empty()
        );
    }

    #[test]
    fn a_victim_within_its_max_loss_goes_before_one_past_its_own() {
        // `strict` would lose 15 min against a maxLoss of 10; `relaxed` 20 min against 30: the
        // least loss alone would take `strict`, past what its CheckpointPolicy allows.
        let urgent = pod("ml", "urgent", 1000, 5);
        let mut strict = running("strict", "ml", 0, 900.0);
        strict.max_loss_seconds = Some(600.0);
        let mut relaxed = running("relaxed", "ml", 0, 1200.0);
        relaxed.max_loss_seconds = Some(1800.0);
        let take = |candidates: &[Running]| {
            preempt(
                SchedulingPolicy::PriorityFair,
                &[&urgent],
                &need(),
                &[],
                candidates,
                &BTreeMap::new(),
            )
            .into_iter()
            .map(|p| p.claim)
            .collect::<Vec<_>>()
        };
        assert_eq!(take(&[strict.clone(), relaxed]), ["ml/relaxed"]);
        // When every victim is past its maxLoss, the least loss still decides.
        let mut over = running("over", "ml", 0, 1200.0);
        over.max_loss_seconds = Some(600.0);
        assert_eq!(take(&[strict, over]), ["ml/strict"]);
    }

    #[test]
    fn a_preemption_under_way_is_kept_while_its_pod_waits_and_never_doubled() {
        let urgent = pod("ml", "urgent", 1000, 5);
        let mut taken = running("a", "ml", 0, 600.0);
        taken.taken_for = Some(("ml/urgent".into(), "priority".into()));
        let candidates = [taken, running("b", "ml", 0, 1.0)];
        let shares = BTreeMap::new();
        let got = preempt(
            SchedulingPolicy::Priority,
            &[&urgent],
            &need(),
            &[],
            &candidates,
            &shares,
        );
        assert_eq!(
            got.iter()
                .map(|p| (p.claim.as_str(), p.reason.as_str()))
                .collect::<Vec<_>>(),
            [("ml/a", "priority")]
        );
        // Its pod no longer waits (it was admitted, or deleted): the preemption is dropped.
        assert!(
            preempt(
                SchedulingPolicy::Priority,
                &[],
                &need(),
                &[],
                &candidates,
                &shares
            )
            .is_empty()
        );
    }

    #[test]
    fn fair_share_preemption_converges_to_the_weights() {
        // Six slices, all held by namespace b (weight 1); namespace a (weight 2) waits.
        let shares_of = |a: u32, b: u32| -> BTreeMap<String, Share> {
            [
                (
                    "a".to_string(),
                    Share {
                        weight: 2.0,
                        holding: a,
                        usage: 0.0,
                    },
                ),
                (
                    "b".to_string(),
                    Share {
                        weight: 1.0,
                        holding: b,
                        usage: 0.0,
                    },
                ),
            ]
            .into()
        };
        let (mut a, mut b) = (0u32, 6u32);
        for round in 0..10 {
            let waiting = pod("a", &format!("a-{round}"), 0, round);
            let victims: Vec<Running> = (0..b)
                .map(|i| running(&format!("b{i}"), "b", 0, 1.0))
                .collect();
            let got = preempt(
                SchedulingPolicy::PriorityFair,
                &[&waiting],
                &need(),
                &[],
                &victims,
                &shares_of(a, b),
            );
            if got.is_empty() {
                break;
            }
            a += 1;
            b -= 1;
        }
        assert_eq!((a, b), (4, 2), "2:1");
    }

    #[test]
    fn a_window_raises_a_policys_priority_while_it_is_open() {
        let pool: gpuslice_api::GpuPool = serde_yaml::from_str(
            "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: shared-a100}
spec:
  nodeSelector: {}
  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}
  windows:
  - name: night
    timeZone: Asia/Shanghai
    start: '20:00'
    end: '08:00'
    layout: {software: {slices: 2, memory: 40Gi, compute: 50}}
    priorities: {bert-finetune: high}
",
        )
        .unwrap();
        let day: DateTime<Utc> = "2026-12-02T04:00:00Z".parse().unwrap();
        let night: DateTime<Utc> = "2026-12-02T14:00:00Z".parse().unwrap();
        let classes: BTreeMap<String, i64> = [("batch-critical".to_string(), 5000)].into();
        let at = |policy: &str, declared: &str, when| {
            priority_in_force(&pool, policy, declared, when, &classes)
        };
        assert_eq!(at("bert-finetune", "normal", day), 100);
        assert_eq!(at("bert-finetune", "normal", night), 1000);
        assert_eq!(at("notebook", "low", night), 0);
        // A PriorityClass name stands for its value; one that does not exist for normal.
        assert_eq!(at("etl", "batch-critical", day), 5000);
        assert_eq!(at("etl", "no-such-class", day), 100);
    }
}
