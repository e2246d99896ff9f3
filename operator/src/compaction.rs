//! Compaction rounds (`GpuPool.spec.compaction`), carried out by the admission queue through
//! its preemption path. A round starts in the pool's compaction window (once per opening) or
//! when the pool's annotation `gpuslice.io/compact-now` takes a new value, and only while nothing of the pool is
//! being admitted. It plans with [`gpuslice_planning::compaction::plan`]; each move becomes a
//! preemption for no pod (the agent drains the workload by its CheckpointPolicy and evicts it,
//! its controller's replacement waits in the queue), and each GPU being emptied is listed in its
//! GpuNode's `spec.compacting` (the agent taints its devices `gpuslice.io/compacting`, and the
//! queue admits nothing there). The round ends once every moved workload has left and nothing
//! of the pool has been admitted or waited for admission for [`SETTLE_SECONDS`]: then the
//! replacements run elsewhere, and the freed GPUs are open again.
//!
//! The round is kept in the pool's `status.compaction` (its own field manager), so a restarted
//! or new leader carries on with it.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use gpuslice_api::{Compaction, CompactionMove, CompactionStatus, GpuPool, Preemption, dra};
use gpuslice_planning::compaction::{Capacity, GpuState, Workload};
use gpuslice_planning::windows::Recurrence;
use kube::ResourceExt as _;

/// The field manager of `GpuPool.status.compaction`.
pub const MANAGER: &str = "gpuslice-compaction";
/// How long a round's moved workloads must have left, with nothing of the pool being admitted,
/// before its GPUs are opened again (a replacement pod appears a moment after its eviction).
pub const SETTLE_SECONDS: i64 = 10;
/// What a move's preemption says (the Event on the moved pod).
const REASON_PREFIX: &str = "compaction";

/// A software slice of a pool, as the queue sees it this pass.
#[derive(Clone, Debug)]
pub struct Slice {
    pub node: String,
    pub gpu: u32,
    pub memory_bytes: u64,
    /// Neither allocated nor tainted.
    pub free: bool,
    pub holder: Option<Holder>,
}

/// The workload holding a slice.
#[derive(Clone, Debug)]
pub struct Holder {
    /// `namespace/name` of its ResourceClaim.
    pub claim: String,
    /// The memory its policy needs (memory + the pool's headroom).
    pub size: u64,
    /// Preemptible, with a CheckpointPolicy, not already being preempted or quarantined.
    pub movable: bool,
}

/// What the queue writes for one pool's compaction this pass.
#[derive(Debug, Default)]
pub struct Step {
    /// Node → the moves to drain there.
    pub preemptions: BTreeMap<String, Vec<Preemption>>,
    /// GPUs being emptied, (node, index).
    pub compacting: BTreeSet<(String, u32)>,
    /// The round to record in the pool's status.
    pub record: Option<CompactionStatus>,
}

/// `node/gpuN`.
pub fn gpu_ref(node: &str, gpu: u32) -> String {
    format!("{node}/gpu{gpu}")
}

fn parse_gpu_ref(s: &str) -> Option<(String, u32)> {
    let (node, gpu) = s.rsplit_once("/gpu")?;
    Some((node.to_string(), gpu.parse().ok()?))
}

/// The rounds this operator wrote, and since when each pool under way has been settled.
#[derive(Debug, Default)]
pub struct Rounds {
    written: BTreeMap<String, CompactionStatus>,
    settled_since: BTreeMap<String, DateTime<Utc>>,
}

impl Rounds {
    /// The pool's last round: its status, or what this operator wrote since if the cache has
    /// not caught up.
    fn last(&self, pool: &GpuPool) -> Option<CompactionStatus> {
        let recorded = pool.status.as_ref().and_then(|s| s.compaction.clone());
        match (recorded, self.written.get(&pool.name_any())) {
            (Some(r), Some(w)) => {
                let started = |c: &CompactionStatus| gpuslice_api::chrono_of(&c.started_at);
                Some(if started(w) >= started(&r) {
                    w.clone()
                } else {
                    r
                })
            }
            (r, w) => r.or_else(|| w.cloned()),
        }
    }

    /// The GPUs a round under way in `pool` is emptying.
    pub fn freeing(&self, pool: &GpuPool) -> BTreeSet<(String, u32)> {
        self.last(pool)
            .filter(|r| r.finished_at.is_none())
            .map(|r| r.freeing.iter().filter_map(|g| parse_gpu_ref(g)).collect())
            .unwrap_or_default()
    }

    /// One pass for `pool`. `slices`: its software slices (asked for only when a round is
    /// planned); `held`: every claim holding a slice now; `quiet`: nothing of the pool was
    /// admitted this pass or waits to be bound after admission. `now` is the operator's clock
    /// (windows).
    pub fn step(
        &mut self,
        pool: &GpuPool,
        slices: impl FnOnce() -> Vec<Slice>,
        held: &BTreeSet<String>,
        quiet: bool,
        now: DateTime<Utc>,
    ) -> Step {
        let mut step = Step::default();
        let name = pool.name_any();
        let Some(settings) = pool.spec.compaction.as_ref().filter(|c| c.enabled) else {
            return step;
        };
        let last = self.last(pool);
        // A value of the annotation no round has taken up yet.
        let asked = pool
            .annotations()
            .get(dra::COMPACT_NOW_ANNOTATION)
            .filter(|v| last.as_ref().is_none_or(|r| r.request.as_ref() != Some(*v)))
            .cloned();
        let recorded = pool.status.as_ref().and_then(|s| s.compaction.clone());
        if let Some(mut round) = last.clone().filter(|r| r.finished_at.is_none()) {
            // Under way: an ask meanwhile is folded into it.
            if asked.is_some() {
                round.request = asked;
                self.written.insert(name.clone(), round.clone());
            }
            return self.under_way(pool, round, held, quiet, now);
        }
        if recorded != last {
            // What this operator wrote last has not reached the status yet: write it again.
            step.record = last.clone();
        }
        let by_window = due_by_window(settings, last.as_ref(), now);
        if !(asked.is_some() || by_window) || !quiet {
            return step;
        }
        if let Some(round) = self.start(pool, slices, asked, last, now) {
            step.record = Some(round);
        }
        step
    }

    /// One pass of the `round` under way in `pool`: over once every moved workload has left
    /// (none of `held`) and the pool has stayed `quiet` for [`SETTLE_SECONDS`]; until then the
    /// moves left are asked for again and the GPUs being emptied stay listed.
    fn under_way(
        &mut self,
        pool: &GpuPool,
        mut round: CompactionStatus,
        held: &BTreeSet<String>,
        quiet: bool,
        now: DateTime<Utc>,
    ) -> Step {
        let mut step = Step::default();
        let name = pool.name_any();
        let left: Vec<&CompactionMove> = round
            .moves
            .iter()
            .filter(|m| held.contains(&m.resource_claim))
            .collect();
        if left.is_empty() && quiet {
            let since = *self.settled_since.entry(name.clone()).or_insert(now);
            if (now - since).num_seconds() >= SETTLE_SECONDS {
                round.finished_at = gpuslice_api::time_of(now);
                self.settled_since.remove(&name);
                self.written.insert(name.clone(), round.clone());
                step.record = Some(round);
                return step;
            }
        } else {
            self.settled_since.remove(&name);
        }
        for m in left {
            let Some((node, _)) = parse_gpu_ref(&m.from) else {
                continue;
            };
            step.preemptions.entry(node).or_default().push(Preemption {
                resource_claim: m.resource_claim.clone(),
                for_pod: String::new(),
                reason: format!("{REASON_PREFIX}: emptying {} of pool {name}", m.from),
            });
        }
        step.compacting = round
            .freeing
            .iter()
            .filter_map(|g| parse_gpu_ref(g))
            .collect();
        let recorded = pool.status.as_ref().and_then(|s| s.compaction.clone());
        if recorded.as_ref() != Some(&round) {
            step.record = Some(round);
        }
        step
    }

    /// Starts a round in `pool`, planned from its `slices`: `asked` by the annotation's value,
    /// else by the window; `last` the round before. `None` when `now` cannot be written.
    fn start(
        &mut self,
        pool: &GpuPool,
        slices: impl FnOnce() -> Vec<Slice>,
        asked: Option<String>,
        last: Option<CompactionStatus>,
        now: DateTime<Utc>,
    ) -> Option<CompactionStatus> {
        let name = pool.name_any();
        let threshold = pool
            .spec
            .compaction
            .as_ref()
            .and_then(|c| c.fragmentation_threshold)
            .unwrap_or(0.3);
        let planned = gpuslice_planning::compaction::plan(&gpu_states(&slices()), threshold);
        let started_at = gpuslice_api::time_of(now)?;
        let at = |(node, gpu): &(String, u32)| gpu_ref(node, *gpu);
        let round = CompactionStatus {
            started_at,
            trigger: if asked.is_some() { "manual" } else { "window" }.to_string(),
            request: asked.or_else(|| last.and_then(|r| r.request)),
            freeing: planned.freed.iter().map(at).collect(),
            moves: planned
                .moves
                .iter()
                .map(|m| CompactionMove {
                    resource_claim: m.workload.clone(),
                    from: at(&m.from),
                    to: at(&m.to),
                })
                .collect(),
            kept: planned.kept,
            // Nothing to move: the round is over as it starts.
            finished_at: planned
                .moves
                .is_empty()
                .then(|| gpuslice_api::time_of(now))
                .flatten(),
        };
        tracing::info!(
            "GpuPool/{name}: compaction ({}) moves {} workload(s) to free {} GPU(s)",
            round.trigger,
            round.moves.len(),
            round.freeing.len()
        );
        self.written.insert(name, round.clone());
        Some(round)
    }
}

/// Whether the pool's compaction window has opened since its `last` round started: a round is
/// due by the window once per opening.
fn due_by_window(
    settings: &Compaction,
    last: Option<&CompactionStatus>,
    now: DateTime<Utc>,
) -> bool {
    let opening = settings
        .window
        .as_ref()
        .and_then(|w| Recurrence::of_daily(w).ok())
        .and_then(|r| {
            r.occurrences(now, now + chrono::Duration::seconds(1))
                .into_iter()
                .find(|o| o.start <= now)
        });
    opening.is_some_and(|o| {
        last.and_then(|r| gpuslice_api::chrono_of(&r.started_at))
            .is_none_or(|started| started < o.start)
    })
}

/// Why a compaction could not be asked for.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("GpuPool {0} does not exist: `kubectl get gpupools` lists the pools")]
    NoSuchPool(String),
    #[error(
        "GpuPool {0} does not compact: set spec.compaction.enabled: true (with a window) in its manifest"
    )]
    NotEnabled(String),
    #[error("GpuPool {pool}: {source}")]
    Api {
        pool: String,
        #[source]
        source: kube::Error,
    },
}

/// Asks the operator for a compaction round of `pool` now: annotates the pool
/// `gpuslice.io/compact-now` with the time (a new value, so a new round).
pub async fn ask(client: &kube::Client, pool: &str) -> Result<(), AskError> {
    use kube::api::{Api, Patch, PatchParams};
    let api: Api<GpuPool> = Api::all(client.clone());
    let api_error = |source| AskError::Api {
        pool: pool.to_string(),
        source,
    };
    let current = api
        .get_opt(pool)
        .await
        .map_err(api_error)?
        .ok_or_else(|| AskError::NoSuchPool(pool.to_string()))?;
    if !current.spec.compaction.as_ref().is_some_and(|c| c.enabled) {
        return Err(AskError::NotEnabled(pool.to_string()));
    }
    let at = Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let patch = serde_json::json!({
        "metadata": {"annotations": {(dra::COMPACT_NOW_ANNOTATION): at}}
    });
    api.patch(pool, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(api_error)?;
    Ok(())
}

/// The planner's view of a pool's software slices: per GPU, equal slices, the free ones, and
/// the workloads holding the others.
fn gpu_states(slices: &[Slice]) -> Vec<GpuState> {
    let mut by_gpu: BTreeMap<(String, u32), Vec<&Slice>> = BTreeMap::new();
    for s in slices {
        by_gpu.entry((s.node.clone(), s.gpu)).or_default().push(s);
    }
    by_gpu
        .into_iter()
        .map(|((node, gpu), slices)| GpuState {
            node,
            gpu,
            capacity: Capacity::Slices {
                size: slices.iter().map(|s| s.memory_bytes).max().unwrap_or(0),
                total: slices.len() as u32,
                free: slices.iter().filter(|s| s.free).count() as u32,
            },
            workloads: slices
                .iter()
                .filter_map(|s| s.holder.as_ref())
                .map(|h| Workload {
                    id: h.claim.clone(),
                    size: h.size,
                    movable: h.movable,
                })
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuslice_api::{Compaction, DailyWindow, GpuPoolStatus};

    const GIB: u64 = 1 << 30;

    fn pool(annotated: bool) -> GpuPool {
        let mut pool: GpuPool = serde_yaml::from_str(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: shared}\nspec:\n  nodeSelector: {}\n  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}\n",
        )
        .unwrap();
        pool.spec.compaction = Some(Compaction {
            enabled: true,
            fragmentation_threshold: Some(0.3),
            window: Some(DailyWindow {
                start: "03:00".into(),
                end: "04:00".into(),
                time_zone: "UTC".into(),
            }),
        });
        if annotated {
            pool.annotations_mut()
                .insert(dra::COMPACT_NOW_ANNOTATION.into(), "1".into());
        }
        pool
    }

    /// Node n: GPU 0 holds `a`, GPU 1 holds `b` and `c`; four 20 GiB slices each.
    fn slices() -> Vec<Slice> {
        let holders = [(0, Some("ns/a")), (1, Some("ns/b")), (1, Some("ns/c"))];
        let mut out = Vec::new();
        for gpu in 0..2 {
            let mine: Vec<&str> = holders
                .iter()
                .filter(|(g, _)| *g == gpu)
                .filter_map(|(_, c)| *c)
                .collect();
            for i in 0..4 {
                out.push(Slice {
                    node: "n".into(),
                    gpu,
                    memory_bytes: 20 * GIB,
                    free: i >= mine.len(),
                    holder: mine.get(i).map(|c| Holder {
                        claim: (*c).into(),
                        size: 9 * GIB,
                        movable: true,
                    }),
                });
            }
        }
        out
    }

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn an_asked_round_moves_the_workload_then_opens_the_gpu_once_things_settle() {
        let mut rounds = Rounds::default();
        let held: BTreeSet<String> = ["ns/a", "ns/b", "ns/c"].map(String::from).into();
        let now = at("2026-12-02T10:00:00Z");
        // Out of the window, not asked: nothing.
        let idle = rounds.step(&pool(false), slices, &held, true, now);
        assert!(idle.record.is_none() && idle.preemptions.is_empty());
        // Asked while pods are being admitted: it waits for a quiet pass.
        let busy = rounds.step(&pool(true), slices, &held, false, now);
        assert!(busy.record.is_none());
        let started = rounds.step(&pool(true), slices, &held, true, now);
        let round = started.record.unwrap();
        assert_eq!(
            (round.trigger.as_str(), round.request.as_deref()),
            ("manual", Some("1"))
        );
        assert_eq!(round.freeing, ["n/gpu0"]);
        assert_eq!(
            round.moves,
            [CompactionMove {
                resource_claim: "ns/a".into(),
                from: "n/gpu0".into(),
                to: "n/gpu1".into()
            }]
        );
        assert!(round.finished_at.is_none());
        // Under way (the cache has not caught up with the status yet): the move is a
        // preemption for no pod, GPU 0 is being emptied.
        let mut p = pool(false);
        let draining = rounds.step(&p, slices, &held, true, now);
        assert_eq!(draining.compacting, BTreeSet::from([("n".to_string(), 0)]));
        let taken = &draining.preemptions["n"];
        assert_eq!(
            (taken[0].resource_claim.as_str(), taken[0].for_pod.as_str()),
            ("ns/a", "")
        );
        assert!(taken[0].reason.starts_with("compaction: emptying n/gpu0"));
        p.status = Some(GpuPoolStatus {
            compaction: Some(round.clone()),
            ..GpuPoolStatus::default()
        });
        // The workload left; its replacement is being admitted: still compacting.
        let gone: BTreeSet<String> = ["ns/b", "ns/c"].map(String::from).into();
        let later = now + chrono::Duration::seconds(30);
        let admitting = rounds.step(&p, slices, &gone, false, later);
        assert!(admitting.preemptions.is_empty() && admitting.record.is_none());
        assert_eq!(admitting.compacting.len(), 1);
        // Quiet: open again only after the settle time.
        let quiet = rounds.step(&p, slices, &gone, true, later);
        assert_eq!(quiet.compacting.len(), 1);
        let done = rounds.step(
            &p,
            slices,
            &gone,
            true,
            later + chrono::Duration::seconds(SETTLE_SECONDS),
        );
        assert!(done.compacting.is_empty());
        let finished = done.record.unwrap();
        assert!(finished.finished_at.is_some());
        // The annotation still says what this round took up: no new round; a new value asks
        // for one.
        let mut asked = pool(true);
        asked.status = Some(GpuPoolStatus {
            compaction: Some(finished),
            ..GpuPoolStatus::default()
        });
        let much_later = later + chrono::Duration::minutes(5);
        let same = rounds.step(&asked, slices, &held, true, much_later);
        assert!(same.record.is_none(), "{same:?}");
        asked
            .annotations_mut()
            .insert(dra::COMPACT_NOW_ANNOTATION.into(), "2".into());
        let again = rounds.step(&asked, slices, &held, true, much_later);
        assert_eq!(again.record.unwrap().request.as_deref(), Some("2"));
    }

    #[test]
    fn the_window_starts_one_round_per_opening() {
        let mut rounds = Rounds::default();
        let held: BTreeSet<String> = ["ns/a", "ns/b", "ns/c"].map(String::from).into();
        let mut p = pool(false);
        let opening = at("2026-12-02T03:10:00Z");
        let first = rounds.step(&p, slices, &held, true, opening);
        let round = first.record.unwrap();
        assert_eq!((round.trigger.as_str(), round.moves.len()), ("window", 1));
        // Ended within the same opening: no second round until the next one.
        let mut ended = round.clone();
        ended.finished_at = gpuslice_api::time_of(opening + chrono::Duration::minutes(5));
        p.status = Some(GpuPoolStatus {
            compaction: Some(ended.clone()),
            ..GpuPoolStatus::default()
        });
        rounds = Rounds::default();
        let again = rounds.step(
            &p,
            slices,
            &held,
            true,
            opening + chrono::Duration::minutes(10),
        );
        assert!(again.record.is_none(), "{again:?}");
        let tomorrow = rounds.step(&p, slices, &held, true, opening + chrono::Duration::days(1));
        assert!(tomorrow.record.is_some());
    }

    #[test]
    fn a_workload_that_may_not_move_keeps_its_gpu() {
        let mut rounds = Rounds::default();
        let held: BTreeSet<String> = ["ns/a", "ns/b", "ns/c"].map(String::from).into();
        let mut pinned = slices();
        pinned[0].holder.as_mut().unwrap().movable = false;
        let step = rounds.step(
            &pool(true),
            || pinned,
            &held,
            true,
            at("2026-12-02T10:00:00Z"),
        );
        let round = step.record.unwrap();
        // GPU 0 keeps its pinned workload; GPU 1's move in beside it instead.
        assert_eq!(round.freeing, ["n/gpu1"]);
        assert!(round.moves.iter().all(|m| m.to == "n/gpu0"));
        assert!(round.kept[0].contains("ns/a may not move"), "{round:?}");
    }
}
