//! Compute arbitration on one GPU: which process may run kernels now. Pure: the caller hands in
//! the time (nanoseconds on one monotonic clock) and carries out the orders that come back.
//!
//! One client (a process under the shim) holds the GPU at a time. Each slice has a **limit**
//! (a cap on its share of time, enforced with a token bucket that fills at the limit's rate, so
//! it holds even when the slice is alone), a **weight** (its fair share when slices contend:
//! the waiter with the least weighted time used goes next) and a **guarantee** (a floor: a slice
//! below it goes before everyone else as soon as the holder has had its minimum slice). A holder
//! keeps the GPU for at least the time slice, gives it up at once when it runs out of work, and
//! is asked to yield when its cap is reached or a waiter should go next. Processes of one slice
//! share its budget. Time is charged from grant to release: the shim releases only once the
//! work it queued has finished, so that is the GPU time the slice's work took.

use std::collections::BTreeMap;

/// A client: one connection from one process.
pub type ClientId = u64;

/// What a slice may have of the GPU, in percent of its time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// Relative weight under contention (the layout's compute share).
    pub weight: u32,
    /// Cap, even on an idle GPU (1–100).
    pub limit: u32,
    /// Floor while it has work queued (0–limit).
    pub guarantee: u32,
}

impl Share {
    /// A slice whose weight and cap are its compute share, with no guarantee.
    pub fn capped(percent: u32) -> Share {
        Share {
            weight: percent,
            limit: percent,
            guarantee: 0,
        }
    }
}

/// What the arbiter wants done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// The client may run kernels until told to yield.
    Grant(ClientId),
    /// The client should finish what it queued and release.
    Yield(ClientId),
}

/// Why a client cannot join.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArbiterError {
    #[error("slice {0} has no compute share on this GPU")]
    UnknownSlice(String),
}

/// What a slice has had, for reports and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// GPU time held (ns).
    pub used: u64,
    /// Time it had work (ns): holding the GPU or waiting for it. `used / busy` is the share it
    /// got while it wanted the GPU, what its guarantee promises.
    pub busy: u64,
    /// Grants.
    pub grants: u64,
    /// Every process's time from asking to being granted, summed (ns).
    pub waited: u64,
    /// Longest wait from asking to being granted (ns).
    pub max_wait: u64,
    /// Every wait from asking to being granted.
    pub waits: Waits,
    /// When (monotonic ns) the slice last held the GPU; `None` while it never has.
    pub last_held: Option<u64>,
}

/// Waits counted in 1 ms buckets (the last one holds everything longer): enough to read a
/// percentile, where one wait stretched by the host's scheduler would decide a maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waits {
    buckets: [u64; Waits::BUCKETS],
}

impl Default for Waits {
    fn default() -> Self {
        Waits {
            buckets: [0; Waits::BUCKETS],
        }
    }
}

impl Waits {
    const BUCKETS: usize = 64;
    const BUCKET_NS: u64 = 1_000_000;

    pub fn record(&mut self, wait_ns: u64) {
        let bucket = ((wait_ns / Self::BUCKET_NS) as usize).min(Self::BUCKETS - 1);
        self.buckets[bucket] += 1;
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The wait (ns, a bucket's upper edge) that `percent` % of waits did not exceed; `None`
    /// before the first wait, or when that percentile lies beyond the last bucket.
    pub fn percentile(&self, percent: f64) -> Option<u64> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        let wanted = ((count as f64 * percent / 100.0).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= wanted {
                return (i + 1 < Self::BUCKETS).then_some((i as u64 + 1) * Self::BUCKET_NS);
            }
        }
        None
    }
}

#[derive(Debug)]
struct Slice {
    share: Share,
    /// Cap budget (ns × 100, exact): fills at `limit`%, drains while holding.
    tokens: i64,
    /// Guarantee credit (ns × 100): fills at `guarantee`%, drains while the slice holds, and
    /// stays ≤ 0 while it wants nothing; positive means it is behind its floor.
    credit: i64,
    /// Weighted time used, for fair order.
    virtual_time: f64,
    usage: Usage,
}

#[derive(Debug)]
struct Client {
    slice: String,
    /// Asking since (ns), when it wants the GPU and does not hold it.
    waiting_since: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Hold {
    client: ClientId,
    since: u64,
    /// When it was asked to yield.
    yield_asked: Option<u64>,
    /// Asked to yield, it launches nothing more (its queued work still runs).
    stopped: bool,
}

/// How long before the end of a holder's minimum slice it is asked to yield (at most a quarter
/// of the slice): about what stopping a holder takes.
const STOP_MARGIN: u64 = 1_000_000;

/// The arbiter of one GPU.
#[derive(Debug)]
pub struct Arbiter {
    time_slice: u64,
    slices: BTreeMap<String, Slice>,
    clients: BTreeMap<ClientId, Client>,
    holder: Option<Hold>,
    /// A holder asked to yield that has not released yet: charged until it does. Once it has
    /// stopped launching, its successor is granted (its kernels queue behind the drain: no gap,
    /// and none of the drainer's launches can land behind them); the successor's slice starts
    /// at the release.
    draining: Option<Hold>,
    last: u64,
    switches: u64,
}

impl Arbiter {
    /// An arbiter whose holders keep the GPU at least `time_slice` ns.
    pub fn new(time_slice: u64, now: u64) -> Arbiter {
        Arbiter {
            time_slice: time_slice.max(1),
            slices: BTreeMap::new(),
            clients: BTreeMap::new(),
            holder: None,
            draining: None,
            last: now,
            switches: 0,
        }
    }

    pub fn time_slice(&self) -> u64 {
        self.time_slice
    }

    /// Changes the minimum slice (the pool's `timeSlice`).
    pub fn set_time_slice(&mut self, time_slice: u64) {
        self.time_slice = time_slice.max(1);
    }

    /// A holder that ignores a yield keeps the GPU this long after being asked, no longer.
    fn revoke_after(&self) -> u64 {
        /// However short the slice, a holder gets this long (ns) to stop before it is overruled.
        const MIN_REVOKE_NS: u64 = 50_000_000;
        self.time_slice.max(MIN_REVOKE_NS)
    }

    /// When `hold` is asked to yield for the next waiter, at the earliest: its minimum slice,
    /// less the moment stopping takes (its in-flight launches, two messages), so that the next
    /// holder's grant lands on the boundary; a guaranteed waiter was promised the GPU within
    /// one time slice. The holder loses no GPU time by it: its queued kernels run on (and are
    /// charged to it) until it releases.
    fn slice_end(&self, hold: Hold) -> u64 {
        hold.since + self.time_slice - STOP_MARGIN.min(self.time_slice / 4)
    }

    /// The most cap budget a slice can save up (ns × 100): a cap holds within this much in any
    /// window.
    fn burst(&self) -> i64 {
        200 * self.time_slice as i64
    }

    /// The budget a slice needs to be granted (ns × 100): half a time slice. Less would mean
    /// switches for slivers; a whole one would leave the GPU idle when caps add up to 100 %
    /// and hand-overs cost a little.
    fn threshold(&self) -> i64 {
        50 * self.time_slice as i64
    }

    /// Sets the slices and their shares; a slice that is gone keeps its clients' budget until
    /// they leave.
    pub fn set_shares(&mut self, shares: &BTreeMap<String, Share>, now: u64) {
        self.advance(now);
        let start = 100 * self.time_slice as i64;
        for (id, share) in shares {
            self.slices
                .entry(id.clone())
                .and_modify(|s| s.share = *share)
                .or_insert(Slice {
                    share: *share,
                    tokens: start,
                    credit: 0,
                    virtual_time: 0.0,
                    usage: Usage::default(),
                });
        }
        let clients = &self.clients;
        self.slices
            .retain(|id, _| shares.contains_key(id) || clients.values().any(|c| &c.slice == id));
    }

    /// A process of `slice` joins.
    pub fn connect(&mut self, client: ClientId, slice: &str) -> Result<(), ArbiterError> {
        if !self.slices.contains_key(slice) {
            return Err(ArbiterError::UnknownSlice(slice.to_string()));
        }
        self.clients.insert(
            client,
            Client {
                slice: slice.to_string(),
                waiting_since: None,
            },
        );
        Ok(())
    }

    /// The client has work and asks for the GPU.
    pub fn acquire(&mut self, client: ClientId, now: u64) {
        self.advance(now);
        if self.holder.is_some_and(|h| h.client == client) {
            return;
        }
        let Some(slice) = self.clients.get(&client).map(|c| c.slice.clone()) else {
            return;
        };
        if !self.wants(&slice) {
            // A slice coming back from idle starts level with those already waiting: fair
            // share is not saved up while idle.
            let floor = self
                .slices
                .iter()
                .filter(|(id, _)| self.wants(id))
                .map(|(_, s)| s.virtual_time)
                .fold(f64::INFINITY, f64::min);
            if let Some(s) = self.slices.get_mut(&slice)
                && floor.is_finite()
            {
                s.virtual_time = s.virtual_time.max(floor);
            }
        }
        if let Some(c) = self.clients.get_mut(&client) {
            c.waiting_since.get_or_insert(now);
        }
    }

    /// The client finished its work (or yielded) and gives the GPU back.
    pub fn release(&mut self, client: ClientId, now: u64) {
        self.advance(now);
        if self.draining.is_some_and(|h| h.client == client) {
            self.draining = None;
            if let Some(next) = self.holder.as_mut() {
                next.since = now;
            }
        }
        if self.holder.is_some_and(|h| h.client == client) {
            self.holder = None;
        }
        if let Some(c) = self.clients.get_mut(&client) {
            c.waiting_since = None;
        }
    }

    /// The client, asked to yield, launches nothing more.
    pub fn stopped(&mut self, client: ClientId, now: u64) {
        self.advance(now);
        if let Some(d) = self.draining.as_mut()
            && d.client == client
        {
            d.stopped = true;
        }
    }

    /// The client is gone (its connection closed: the process exited or was killed).
    pub fn disconnect(&mut self, client: ClientId, now: u64) {
        self.release(client, now);
        self.clients.remove(&client);
    }

    /// Decides: a yield for a holder that should stop, a grant when the GPU is free.
    pub fn step(&mut self, now: u64) -> Vec<Order> {
        self.advance(now);
        let mut orders = Vec::new();
        // A holder that does not finish its yield in time is charged no longer.
        if let Some(d) = self.draining
            && now >= d.yield_asked.unwrap_or(now) + self.revoke_after()
        {
            self.release(d.client, now);
        }
        if let Some(hold) = self.holder {
            if self.draining.is_some() || !self.should_yield(hold, now) {
                return orders;
            }
            self.draining = Some(Hold {
                yield_asked: Some(now),
                ..hold
            });
            self.holder = None;
            orders.push(Order::Yield(hold.client));
        }
        if self.draining.is_some_and(|d| !d.stopped) {
            return orders;
        }
        if let Some(client) = self.next_client(self.draining.map(|d| d.client)) {
            let c = self.clients.get_mut(&client).expect("a waiting client");
            let waited = now.saturating_sub(c.waiting_since.take().unwrap_or(now));
            let slice = self.slices.get_mut(&c.slice).expect("a client's slice");
            slice.usage.grants += 1;
            slice.usage.waited += waited;
            slice.usage.max_wait = slice.usage.max_wait.max(waited);
            slice.usage.waits.record(waited);
            self.holder = Some(Hold {
                client,
                since: now,
                yield_asked: None,
                stopped: false,
            });
            self.switches += 1;
            orders.push(Order::Grant(client));
        }
        orders
    }

    /// When [`Arbiter::step`] should run next if nothing else happens.
    pub fn next_wake(&self, now: u64) -> Option<u64> {
        let mut wake: Option<u64> = None;
        let mut at = |t: u64| wake = Some(wake.map_or(t, |w| w.min(t)));
        let threshold = self.threshold();
        // Time (ns, rounded up) for a budget changing at `rate` per ns to cover `gap`.
        let after = |gap: i64, rate: i64| now + (gap.max(0) + rate - 1) as u64 / rate.max(1) as u64;
        if let Some(asked) = self.draining.and_then(|d| d.yield_asked) {
            at(asked + self.revoke_after());
        }
        if let Some(hold) = self.holder.filter(|_| self.draining.is_none()) {
            let id = &self.clients[&hold.client].slice;
            let slice = &self.slices[id];
            if slice.share.limit < 100 {
                at(after(slice.tokens, 100 - i64::from(slice.share.limit)));
            }
            if let Some(next) = self.next_client(Some(hold.client)) {
                let end = self.slice_end(hold);
                if now < end {
                    at(end);
                } else if slice.share.guarantee > 0 && slice.credit > 0 {
                    // It keeps the GPU until it has caught up with its floor.
                    at(after(
                        slice.credit,
                        100 - i64::from(slice.share.guarantee.min(99)),
                    ));
                } else {
                    // It keeps the GPU until its fair-share clock passes the next waiter's.
                    let other = &self.clients[&next].slice;
                    if self.rank(other).0 == self.holder_rank(id).0 {
                        let gap = self.slices[other].virtual_time - slice.virtual_time;
                        let weight = f64::from(slice.share.weight.max(1));
                        at(now + (gap.max(0.0) * weight).ceil() as u64 + 1);
                    }
                }
            }
        }
        for (id, slice) in &self.slices {
            let waiting = self
                .clients
                .values()
                .any(|c| &c.slice == id && c.waiting_since.is_some());
            if !waiting {
                continue;
            }
            if slice.tokens < threshold {
                at(after(
                    threshold - slice.tokens,
                    i64::from(slice.share.limit.max(1)),
                ));
            }
            // A guaranteed waiter coming close enough to its floor goes first.
            if slice.share.guarantee > 0 && slice.credit <= -self.urgency(slice) {
                at(after(
                    1 - self.urgency(slice) - slice.credit,
                    i64::from(slice.share.guarantee),
                ));
            }
        }
        wake
    }

    /// What each slice has had up to `now` (a holder's time so far counts).
    pub fn usage_at(&mut self, now: u64) -> BTreeMap<String, Usage> {
        self.advance(now);
        self.usage()
    }

    /// What each slice has had.
    pub fn usage(&self) -> BTreeMap<String, Usage> {
        self.slices
            .iter()
            .map(|(id, s)| (id.clone(), s.usage))
            .collect()
    }

    /// How many times the GPU changed hands.
    pub fn switches(&self) -> u64 {
        self.switches
    }

    /// Each slice's cap (%).
    pub fn limits(&self) -> BTreeMap<String, u32> {
        self.slices
            .iter()
            .map(|(id, s)| (id.clone(), s.share.limit))
            .collect()
    }

    /// The cap of a client's slice (%).
    pub fn limit_of(&self, client: ClientId) -> Option<u32> {
        let slice = &self.clients.get(&client)?.slice;
        Some(self.slices.get(slice)?.share.limit)
    }

    /// Whether any client other than `except` waits for the GPU.
    pub fn has_waiters(&self, except: ClientId) -> bool {
        self.clients
            .iter()
            .any(|(id, c)| *id != except && c.waiting_since.is_some())
    }

    /// The client holding the GPU.
    pub fn holder(&self) -> Option<ClientId> {
        self.holder.map(|h| h.client)
    }

    /// The slice charged now: the one draining, else the holder's.
    fn holding_slice(&self) -> Option<&str> {
        self.draining
            .or(self.holder)
            .and_then(|h| self.clients.get(&h.client))
            .map(|c| c.slice.as_str())
    }

    fn wants(&self, slice: &str) -> bool {
        [self.holder, self.draining].iter().flatten().any(|h| {
            self.clients
                .get(&h.client)
                .is_some_and(|c| c.slice == slice)
        }) || self
            .clients
            .values()
            .any(|c| c.slice == slice && c.waiting_since.is_some())
    }

    /// Brings budgets, credits and fair-share clocks up to `now`.
    fn advance(&mut self, now: u64) {
        let dt = now.saturating_sub(self.last) as i64;
        self.last = self.last.max(now);
        if dt == 0 {
            return;
        }
        let burst = self.burst();
        let holding = self.holding_slice().map(str::to_string);
        let wanting: Vec<bool> = self.slices.keys().map(|id| self.wants(id)).collect();
        for ((id, slice), wants) in self.slices.iter_mut().zip(wanting) {
            let holds = holding.as_deref() == Some(id.as_str());
            if wants {
                slice.usage.busy += dt as u64;
            }
            slice.tokens += dt * i64::from(slice.share.limit);
            if holds {
                slice.tokens -= dt * 100;
                slice.usage.used += dt as u64;
                slice.usage.last_held = Some(now);
                slice.virtual_time += dt as f64 / f64::from(slice.share.weight.max(1));
            }
            slice.tokens = slice.tokens.min(burst);
            slice.credit += dt * i64::from(slice.share.guarantee);
            if holds {
                slice.credit -= dt * 100;
            }
            slice.credit = if wants {
                slice.credit.clamp(-burst, burst)
            } else {
                // An idle slice saves up no floor, but the moment between a release and the
                // next acquire does not wipe out what it took beyond its floor either: its debt
                // is paid off at its guarantee's rate.
                slice.credit.clamp(-burst, 0)
            };
        }
    }

    /// How far ahead of its floor (credit, ns × 100) a waiting guaranteed slice may be and still
    /// go first: one time slice of its guarantee, so with a guarantee of 50 % it takes every
    /// other turn and waits at most one time slice.
    fn urgency(&self, slice: &Slice) -> i64 {
        self.time_slice as i64 * i64::from(slice.share.guarantee)
    }

    /// Order among waiting slices: guaranteed slices close to their floor first, then least
    /// weighted time used.
    fn rank(&self, slice: &str) -> (bool, f64) {
        let s = &self.slices[slice];
        (
            !(s.share.guarantee > 0 && s.credit > -self.urgency(s)),
            s.virtual_time,
        )
    }

    /// The holder's order against waiters: first only while behind its floor.
    fn holder_rank(&self, slice: &str) -> (bool, f64) {
        let s = &self.slices[slice];
        (!(s.share.guarantee > 0 && s.credit > 0), s.virtual_time)
    }

    /// The waiting client that should have the GPU next (other than `except`): from the best
    /// ranked slice whose cap allows a full time slice, its longest waiting process.
    fn next_client(&self, except: Option<ClientId>) -> Option<ClientId> {
        let threshold = self.threshold();
        self.clients
            .iter()
            .filter(|(id, c)| Some(**id) != except && c.waiting_since.is_some())
            .filter(|(_, c)| self.slices[&c.slice].tokens >= threshold)
            .min_by(|(a_id, a), (b_id, b)| {
                let (ra, rb) = (self.rank(&a.slice), self.rank(&b.slice));
                ra.0.cmp(&rb.0)
                    .then(ra.1.total_cmp(&rb.1))
                    .then(a.waiting_since.cmp(&b.waiting_since))
                    .then(a_id.cmp(b_id))
            })
            .map(|(id, _)| *id)
    }

    fn should_yield(&self, hold: Hold, now: u64) -> bool {
        let slice = &self.clients[&hold.client].slice;
        if self.slices[slice].tokens <= 0 {
            return true; // its cap
        }
        if now < self.slice_end(hold) {
            return false; // its minimum slice
        }
        let share = &self.slices[slice];
        if share.share.guarantee > 0 && share.credit > 0 {
            return false; // still behind its floor
        }
        let Some(next) = self.next_client(Some(hold.client)) else {
            return false;
        };
        let other = &self.clients[&next].slice;
        // A process of the same slice takes turns; another slice goes when it ranks first.
        other == slice || self.rank(other) < self.holder_rank(slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A GPU where every client always has work: grants are taken at once and yields obeyed
    /// at once. Returns each slice's share (%) over `[from, to)` ms.
    fn simulate(
        shares: &[(&str, Share, usize)],
        time_slice_ms: u64,
        from_ms: u64,
        to_ms: u64,
    ) -> BTreeMap<String, f64> {
        simulate_with_usage(shares, time_slice_ms, from_ms, to_ms).0
    }

    fn simulate_with_usage(
        shares: &[(&str, Share, usize)],
        time_slice_ms: u64,
        from_ms: u64,
        to_ms: u64,
    ) -> (BTreeMap<String, f64>, BTreeMap<String, Usage>) {
        let mut arbiter = Arbiter::new(time_slice_ms * MS, 0);
        let table = shares
            .iter()
            .map(|(id, s, _)| (id.to_string(), *s))
            .collect();
        arbiter.set_shares(&table, 0);
        let mut next = 1;
        for (id, _, processes) in shares {
            for _ in 0..*processes {
                arbiter.connect(next, id).unwrap();
                arbiter.acquire(next, 0);
                next += 1;
            }
        }
        let mut held: BTreeMap<String, u64> = BTreeMap::new();
        let mut now = 0;
        let mut owner: Option<(ClientId, u64)> = None;
        while now < to_ms * MS {
            let mut released = false;
            for order in arbiter.step(now) {
                match order {
                    Order::Grant(c) => owner = Some((c, now)),
                    Order::Yield(c) => {
                        let (_, since) = owner.take().unwrap();
                        let slice = arbiter.clients[&c].slice.clone();
                        let a = since.max(from_ms * MS);
                        *held.entry(slice).or_default() += now.saturating_sub(a);
                        arbiter.release(c, now);
                        arbiter.acquire(c, now);
                        released = true;
                    }
                }
            }
            if !released {
                // Nothing due: nothing changes until the end (a stall shows as a wrong share).
                now = arbiter.next_wake(now).unwrap_or(to_ms * MS).max(now + 1);
            }
        }
        if let Some((c, since)) = owner {
            let slice = arbiter.clients[&c].slice.clone();
            *held.entry(slice).or_default() += (to_ms * MS).saturating_sub(since.max(from_ms * MS));
        }
        let span = ((to_ms - from_ms) * MS) as f64;
        let shares = held
            .into_iter()
            .map(|(k, v)| (k, v as f64 / span * 100.0))
            .collect();
        (shares, arbiter.usage())
    }

    fn near(actual: &BTreeMap<String, f64>, expected: &[(&str, f64)]) {
        for (id, want) in expected {
            let got = actual.get(*id).copied().unwrap_or(0.0);
            assert!(
                (got - want).abs() <= 1.5,
                "{id}: {got:.2}% instead of {want}% ({actual:?})"
            );
        }
    }

    #[test]
    fn caps_split_a_contended_gpu_10_90() {
        let s = simulate(
            &[("a", Share::capped(10), 1), ("b", Share::capped(90), 1)],
            10,
            1000,
            3000,
        );
        near(&s, &[("a", 10.0), ("b", 90.0)]);
    }

    #[test]
    fn a_cap_holds_when_the_slice_is_alone() {
        let s = simulate(&[("a", Share::capped(25), 1)], 10, 1000, 3000);
        near(&s, &[("a", 25.0)]);
    }

    #[test]
    fn weights_share_what_caps_allow_and_guarantees_go_first() {
        let best_effort = Share {
            weight: 25,
            limit: 100,
            guarantee: 0,
        };
        let guaranteed = Share {
            weight: 10,
            limit: 100,
            guarantee: 50,
        };
        let (s, usage) = simulate_with_usage(
            &[
                ("g", guaranteed, 1),
                ("x", best_effort, 1),
                ("y", best_effort, 1),
            ],
            10,
            1000,
            3000,
        );
        // Weights alone would give g 1/6; its guarantee lifts it to 50.
        near(&s, &[("g", 50.0), ("x", 25.0), ("y", 25.0)]);
        assert!(
            usage["g"].max_wait <= 10 * MS,
            "the guaranteed slice waited {} ms",
            usage["g"].max_wait as f64 / MS as f64
        );
        assert_eq!(usage["g"].waits.count(), usage["g"].grants);
        assert!(usage["g"].waits.percentile(99.0).unwrap() <= 11 * MS);
        // Always busy: what each got while it wanted the GPU is its share, and a lone process's
        // busy time is what it held plus what it waited.
        for (id, want) in [("g", 0.5), ("x", 0.25), ("y", 0.25)] {
            let u = usage[id];
            let got = u.used as f64 / u.busy as f64;
            assert!((got - want).abs() < 0.02, "{id}: {got:.3} of its busy time");
            let unexplained = u.busy.abs_diff(u.used + u.waited) as f64 / u.busy as f64;
            assert!(unexplained < 0.01, "{id}: {u:?}");
        }
    }

    #[test]
    fn a_percentile_of_waits_ignores_one_outlier() {
        let mut waits = Waits::default();
        assert_eq!(waits.percentile(99.0), None);
        for _ in 0..199 {
            waits.record(3 * MS + 200_000);
        }
        waits.record(19 * MS);
        assert_eq!(waits.percentile(99.0), Some(4 * MS));
        assert_eq!(waits.percentile(100.0), Some(20 * MS));
        waits.record(500 * MS);
        waits.record(500 * MS);
        waits.record(500 * MS);
        assert_eq!(waits.percentile(99.0), None, "beyond the last bucket");
    }

    #[test]
    fn processes_of_one_slice_share_its_budget() {
        let s = simulate(
            &[("a", Share::capped(30), 3), ("b", Share::capped(70), 1)],
            10,
            1000,
            3000,
        );
        near(&s, &[("a", 30.0), ("b", 70.0)]);
    }

    #[test]
    fn a_holder_is_asked_to_yield_after_its_time_slice_and_revoked_if_it_ignores_it() {
        let mut arbiter = Arbiter::new(10 * MS, 0);
        let shares = [
            ("a".to_string(), Share::capped(50)),
            ("b".to_string(), Share::capped(50)),
        ]
        .into();
        arbiter.set_shares(&shares, 0);
        arbiter.connect(1, "a").unwrap();
        arbiter.connect(2, "b").unwrap();
        arbiter.acquire(1, 0);
        assert_eq!(arbiter.step(0), [Order::Grant(1)]);
        arbiter.acquire(2, MS);
        assert_eq!(arbiter.step(MS), [], "a keeps its minimum slice");
        // Asked to yield the moment stopping takes before its slice ends.
        let asked = 10 * MS - STOP_MARGIN;
        assert_eq!(arbiter.next_wake(MS), Some(asked));
        assert_eq!(arbiter.step(asked - 1), []);
        assert_eq!(arbiter.step(asked), [Order::Yield(1)]);
        // b is granted once a launches nothing more: its kernels queue behind a's last ones.
        arbiter.stopped(1, asked + 100_000);
        assert_eq!(arbiter.step(asked + 100_000), [Order::Grant(2)]);
        // a never releases: it is charged until the revocation time, b's slice starts then.
        let revoke = asked + arbiter.revoke_after();
        assert_eq!(arbiter.next_wake(asked + MS), Some(revoke));
        assert_eq!(arbiter.step(revoke - 1), []);
        let used_a = arbiter.usage()["a"].used;
        assert_eq!(arbiter.step(revoke), []);
        assert_eq!(
            arbiter.usage()["a"].used,
            used_a + 1,
            "a's charge stops at revocation"
        );
        assert_eq!(arbiter.holder(), Some(2));
    }

    #[test]
    fn a_guaranteed_waiter_gets_the_gpu_within_one_slice_though_stopping_takes_a_while() {
        let mut arbiter = Arbiter::new(10 * MS, 0);
        let guaranteed = Share {
            weight: 50,
            limit: 100,
            guarantee: 50,
        };
        arbiter.set_shares(
            &[
                ("a".to_string(), Share::capped(100)),
                ("g".to_string(), guaranteed),
            ]
            .into(),
            0,
        );
        arbiter.connect(1, "a").unwrap();
        arbiter.connect(2, "g").unwrap();
        arbiter.acquire(1, 0);
        assert_eq!(arbiter.step(0), [Order::Grant(1)]);
        arbiter.acquire(2, 0);
        // The yield goes out early enough for a holder that takes 0.8 ms to stop.
        let asked = arbiter.next_wake(0).unwrap();
        assert!(asked < 10 * MS, "asked to yield at {asked} ns");
        assert_eq!(arbiter.step(asked), [Order::Yield(1)]);
        arbiter.stopped(1, asked + 800_000);
        assert_eq!(arbiter.step(asked + 800_000), [Order::Grant(2)]);
        assert!(arbiter.usage()["g"].max_wait <= 10 * MS);
    }

    #[test]
    fn a_holder_that_never_stops_launching_is_revoked_and_the_waiter_granted() {
        let mut arbiter = Arbiter::new(10 * MS, 0);
        arbiter.set_shares(
            &[
                ("a".to_string(), Share::capped(50)),
                ("b".to_string(), Share::capped(50)),
            ]
            .into(),
            0,
        );
        arbiter.connect(1, "a").unwrap();
        arbiter.connect(2, "b").unwrap();
        arbiter.acquire(1, 0);
        assert_eq!(arbiter.step(0), [Order::Grant(1)]);
        arbiter.acquire(2, 0);
        let asked = 10 * MS - STOP_MARGIN;
        assert_eq!(arbiter.step(asked), [Order::Yield(1)]);
        let revoke = asked + arbiter.revoke_after();
        assert_eq!(arbiter.next_wake(asked), Some(revoke));
        assert_eq!(
            arbiter.step(revoke - 1),
            [],
            "b waits while a may still launch"
        );
        assert_eq!(arbiter.step(revoke), [Order::Grant(2)]);
    }

    #[test]
    fn a_disconnected_holder_frees_the_gpu_at_once() {
        let mut arbiter = Arbiter::new(10 * MS, 0);
        arbiter.set_shares(&[("a".to_string(), Share::capped(100))].into(), 0);
        arbiter.connect(1, "a").unwrap();
        arbiter.connect(2, "a").unwrap();
        arbiter.acquire(1, 0);
        arbiter.acquire(2, 0);
        assert_eq!(arbiter.step(0), [Order::Grant(1)]);
        arbiter.disconnect(1, 2 * MS);
        assert_eq!(arbiter.step(2 * MS), [Order::Grant(2)]);
    }

    #[test]
    fn an_unknown_slice_is_refused() {
        let mut arbiter = Arbiter::new(10 * MS, 0);
        assert_eq!(
            arbiter.connect(1, "gpu0-s9"),
            Err(ArbiterError::UnknownSlice("gpu0-s9".into()))
        );
    }
}
