//! Placement's data: a substrate's named GPUs arranged for finding free ones fast
//! ([`FleetIndex`]), the GPUs open leases hold with their latest changes ([`HeldGpus`]), and what
//! placement keeps from one decision to the next ([`Placements`]), which the caller owns and
//! passes to [`super::evaluate`], so every input of a decision is in its arguments.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpuwarden_schema::Workload;

use crate::inventory::{Gpu, Inventory};

/// A substrate's named GPUs arranged for placement: by model, then by host, with the hosts
/// ordered by name and by size. Built once per inventory, so that placing a lease costs in the
/// GPUs open leases hold and the few hosts it looks at, not in every GPU of the fleet: on a
/// fleet of thousands of GPUs a full scan per admission was the admission's largest cost.
#[derive(Debug)]
pub struct FleetIndex {
    inventory: Arc<Inventory>,
    /// Models of named GPUs, in the order the inventory first lists them.
    pub(super) models: Vec<ModelHosts>,
    /// A GPU's UUID → its (model, host) slots.
    at: HashMap<String, (usize, usize)>,
}

/// The hosts holding GPUs of one model.
#[derive(Debug)]
pub(super) struct ModelHosts {
    /// Position in the inventory of the model's first GPU (whose `model` names it).
    pub(super) first: usize,
    /// Each host's GPUs of the model (positions in the inventory, by index), hosts by name.
    hosts: Vec<Vec<usize>>,
    /// GPUs of the model.
    total: usize,
}

impl FleetIndex {
    /// Arranges `inventory`'s named GPUs (one pass and a sort; pooled capacity needs none).
    pub fn new(inventory: Arc<Inventory>) -> Self {
        let gpus = &inventory.gpus;
        let mut models: Vec<ModelHosts> = Vec::new();
        // Per model: host name → its GPUs' positions.
        let mut grouped: Vec<BTreeMap<&str, Vec<usize>>> = Vec::new();
        let mut model_slot: HashMap<&str, usize> = HashMap::new();
        for (position, gpu) in gpus.iter().enumerate() {
            let m = *model_slot.entry(gpu.model.as_str()).or_insert_with(|| {
                models.push(ModelHosts {
                    first: position,
                    hosts: Vec::new(),
                    total: 0,
                });
                grouped.push(BTreeMap::new());
                models.len() - 1
            });
            grouped[m]
                .entry(gpu.host.as_str())
                .or_default()
                .push(position);
        }
        let mut at = HashMap::with_capacity(gpus.len());
        for (m, (model, hosts)) in models.iter_mut().zip(grouped).enumerate() {
            for (h, (_, mut positions)) in hosts.into_iter().enumerate() {
                positions.sort_by_key(|&p| gpus[p].index);
                for &p in &positions {
                    at.insert(gpus[p].uuid.clone(), (m, h));
                }
                model.total += positions.len();
                model.hosts.push(positions);
            }
        }
        Self {
            inventory,
            models,
            at,
        }
    }

    /// Whether this index was built from `inventory` (the same report, not an equal one).
    pub fn is_of(&self, inventory: &Arc<Inventory>) -> bool {
        Arc::ptr_eq(&self.inventory, inventory)
    }

    pub(super) fn model_name(&self, m: usize) -> &str {
        &self.inventory.gpus[self.models[m].first].model
    }

    pub(super) fn host_name(&self, m: usize, h: usize) -> &str {
        &self.inventory.gpus[self.models[m].hosts[h][0]].host
    }
}

/// An index equals another built from an equal inventory (it is a function of it).
impl PartialEq for FleetIndex {
    fn eq(&self, other: &Self) -> bool {
        self.inventory == other.inventory
    }
}

/// How many changes [`HeldGpus`] remembers. Placement reads the holdings on every admission, so
/// it is rarely more than a few changes behind; further behind, it recounts.
pub(super) const RECENT_CHANGES: usize = 4096;

/// The GPUs open leases hold on one substrate, with the latest changes to them: placement keeps
/// each host's free GPUs and brings them up to date from the changes alone, instead of
/// recounting every held GPU on every admission.
#[derive(Debug)]
pub struct HeldGpus {
    uuids: BTreeSet<String>,
    /// Which history of changes this is. A clone starts its own (the two may then change
    /// apart), so a count kept for one is never carried over to the other by mistake.
    origin: u64,
    /// Changes made so far.
    version: u64,
    /// The latest changes, oldest first: a UUID and whether it became held.
    recent: VecDeque<(String, bool)>,
}

impl HeldGpus {
    fn fresh_origin() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    fn record(&mut self, uuid: String, held: bool) {
        if self.recent.len() == RECENT_CHANGES {
            self.recent.pop_front();
        }
        self.recent.push_back((uuid, held));
        self.version += 1;
    }

    /// Marks `uuid` held; false if it already was.
    pub fn insert(&mut self, uuid: String) -> bool {
        if self.uuids.contains(&uuid) {
            return false;
        }
        self.uuids.insert(uuid.clone());
        self.record(uuid, true);
        true
    }

    /// Marks `uuid` free; false if it was not held.
    pub fn remove(&mut self, uuid: &str) -> bool {
        if !self.uuids.remove(uuid) {
            return false;
        }
        self.record(uuid.to_owned(), false);
        true
    }

    /// Whether `uuid` is held.
    pub fn contains(&self, uuid: &str) -> bool {
        self.uuids.contains(uuid)
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.uuids.is_empty()
    }

    /// The held UUIDs, in order.
    pub fn iter(&self) -> impl Iterator<Item = &String> {
        self.uuids.iter()
    }

    /// The changes after the first `version` of this history, if it still has them all.
    fn changes_since(
        &self,
        origin: u64,
        version: u64,
    ) -> Option<impl Iterator<Item = &(String, bool)>> {
        let first = self.version - self.recent.len() as u64;
        (origin == self.origin && (first..=self.version).contains(&version))
            .then(|| self.recent.iter().skip((version - first) as usize))
    }
}

impl Default for HeldGpus {
    fn default() -> Self {
        Self {
            uuids: BTreeSet::new(),
            origin: Self::fresh_origin(),
            version: 0,
            recent: VecDeque::new(),
        }
    }
}

impl Clone for HeldGpus {
    fn clone(&self) -> Self {
        Self {
            uuids: self.uuids.clone(),
            origin: Self::fresh_origin(),
            version: 0,
            recent: VecDeque::new(),
        }
    }
}

/// Two holdings are equal when they hold the same GPUs, whatever their histories.
impl PartialEq for HeldGpus {
    fn eq(&self, other: &Self) -> bool {
        self.uuids == other.uuids
    }
}

impl Extend<String> for HeldGpus {
    fn extend<I: IntoIterator<Item = String>>(&mut self, uuids: I) {
        for uuid in uuids {
            self.insert(uuid);
        }
    }
}

impl<const N: usize> From<[&str; N]> for HeldGpus {
    fn from(uuids: [&str; N]) -> Self {
        let mut held = Self::default();
        held.extend(uuids.map(str::to_owned));
        held
    }
}

/// Free GPUs per host of an index, as of one version of one history of holdings.
#[derive(Debug)]
pub(super) struct FreeState {
    origin: u64,
    version: u64,
    models: Vec<ModelFree>,
}

/// One model's free GPUs: per host, and the hosts with any free ordered both ways placement
/// looks for them.
#[derive(Debug)]
struct ModelFree {
    /// Free GPUs per host slot.
    free: Vec<usize>,
    /// GPUs held.
    held: usize,
    /// Hosts with free GPUs as (free, slot): the first from `n` up is the tightest fit.
    tightest: BTreeSet<(usize, usize)>,
    /// Hosts with free GPUs as (most free first, slot): where spreading and filling start.
    fullest: BTreeSet<(Reverse<usize>, usize)>,
}

impl ModelFree {
    fn set(&mut self, h: usize, free: usize) {
        let before = self.free[h];
        if before > 0 {
            self.tightest.remove(&(before, h));
            self.fullest.remove(&(Reverse(before), h));
        }
        if free > 0 {
            self.tightest.insert((free, h));
            self.fullest.insert((Reverse(free), h));
        }
        self.free[h] = free;
    }
}

impl FreeState {
    /// Counts from scratch: every host free, less what `held` holds.
    fn count(index: &FleetIndex, held: &HeldGpus) -> Self {
        let mut models: Vec<ModelFree> = index
            .models
            .iter()
            .map(|model| ModelFree {
                free: model.hosts.iter().map(Vec::len).collect(),
                held: 0,
                tightest: BTreeSet::new(),
                fullest: BTreeSet::new(),
            })
            .collect();
        // UUIDs the inventory no longer lists hold nothing placement could use.
        for &(m, h) in held.iter().filter_map(|uuid| index.at.get(uuid)) {
            models[m].free[h] -= 1;
            models[m].held += 1;
        }
        for model in &mut models {
            for (h, &free) in model.free.iter().enumerate().filter(|(_, &f)| f > 0) {
                model.tightest.insert((free, h));
                model.fullest.insert((Reverse(free), h));
            }
        }
        Self {
            origin: held.origin,
            version: held.version,
            models,
        }
    }

    /// Brings the counts to `held`: from its changes when it has all those since, else anew.
    fn update(state: &mut Option<Self>, index: &FleetIndex, held: &HeldGpus) {
        if let Some(s) = state.as_mut() {
            if let Some(changes) = held.changes_since(s.origin, s.version) {
                for (uuid, now_held) in changes {
                    let Some(&(m, h)) = index.at.get(uuid) else {
                        continue;
                    };
                    let model = &mut s.models[m];
                    let free = model.free[h];
                    match now_held {
                        true => {
                            model.held += 1;
                            model.set(h, free - 1);
                        }
                        false => {
                            model.held -= 1;
                            model.set(h, free + 1);
                        }
                    }
                }
                s.version = held.version;
                return;
            }
        }
        *state = Some(Self::count(index, held));
    }
}

/// One substrate's free named GPUs as one request sees them: the index and its free counts,
/// brought to the holdings the request read.
pub(super) struct FreeGpus<'a> {
    pub(super) index: &'a FleetIndex,
    held: &'a HeldGpus,
    state: &'a FreeState,
}

impl<'a> FreeGpus<'a> {
    /// `index`'s free GPUs under `held`, bringing `kept` (the counts of an earlier call on the
    /// same index, if any) up to date.
    pub(super) fn new(
        index: &'a FleetIndex,
        held: &'a HeldGpus,
        kept: &'a mut Option<FreeState>,
    ) -> Self {
        FreeState::update(kept, index, held);
        let state = kept
            .as_ref()
            .expect("FreeState::update always leaves counts");
        Self { index, held, state }
    }

    fn model(&self, m: usize) -> &ModelFree {
        &self.state.models[m]
    }

    pub(super) fn of_model(&self, m: usize) -> usize {
        self.index.models[m].total - self.model(m).held
    }

    /// A host's free GPUs of model `m`, by index.
    fn gpus(&self, m: usize, h: usize) -> Vec<&'a Gpu> {
        let gpus = &self.index.inventory.gpus;
        let positions = self.index.models[m].hosts[h].iter().map(|&p| &gpus[p]);
        match self.model(m).free[h] == self.index.models[m].hosts[h].len() {
            true => positions.collect(),
            false => positions.filter(|g| !self.held.contains(&g.uuid)).collect(),
        }
    }

    /// `n` free GPUs of model `m` (there are at least `n`), picked as [`pick`] picks among
    /// every host, from only the hosts that can matter: the tightest that fits (training,
    /// batch), else the fullest until `n` are free among them; the `n` fullest (inference,
    /// notebooks: round-robin takes one from each of them before a second from any).
    pub(super) fn choose(&self, m: usize, n: usize, workload: Workload) -> Vec<String> {
        let model = self.model(m);
        let mut slots: Vec<usize> = match workload {
            Workload::Training | Workload::Batch => match model.tightest.range((n, 0)..).next() {
                Some(&(_, h)) => vec![h],
                None => {
                    let mut free = 0;
                    model
                        .fullest
                        .iter()
                        .take_while(|&&(Reverse(f), _)| {
                            let more = free < n;
                            free += f;
                            more
                        })
                        .map(|&(_, h)| h)
                        .collect()
                }
            },
            Workload::Inference | Workload::Notebook => {
                model.fullest.iter().take(n).map(|&(_, h)| h).collect()
            }
        };
        slots.sort_unstable();
        let hosts: Vec<(&str, Vec<&Gpu>)> = slots
            .into_iter()
            .map(|h| (self.index.host_name(m, h), self.gpus(m, h)))
            .collect();
        pick(hosts, n, workload)
    }
}

/// Picks `n` of the free GPUs of `hosts` (by name, each with its free GPUs by index):
/// training and batch pack onto as few hosts as possible (keeping whole hosts free for the next
/// big job); inference and notebooks spread across hosts, so one host's failure takes down as
/// little of a service as possible.
pub(super) fn pick(mut hosts: Vec<(&str, Vec<&Gpu>)>, n: usize, workload: Workload) -> Vec<String> {
    let mut chosen = Vec::with_capacity(n);
    match workload {
        Workload::Training | Workload::Batch => {
            // One host if any fits (the tightest fit), else the fullest hosts first.
            if let Some((_, gpus)) = hosts
                .iter()
                .filter(|(_, g)| g.len() >= n)
                .min_by_key(|(h, g)| (g.len(), *h))
            {
                return gpus[..n].iter().map(|g| g.uuid.clone()).collect();
            }
            hosts.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(b.0)));
            for (_, gpus) in &hosts {
                for g in gpus {
                    if chosen.len() == n {
                        break;
                    }
                    chosen.push(g.uuid.clone());
                }
            }
        }
        Workload::Inference | Workload::Notebook => {
            // Round-robin: the host given fewest so far next, the one with most free first.
            let mut taken = vec![0usize; hosts.len()];
            while chosen.len() < n {
                let Some(i) = (0..hosts.len())
                    .filter(|&i| taken[i] < hosts[i].1.len())
                    .min_by_key(|&i| (taken[i], std::cmp::Reverse(hosts[i].1.len()), hosts[i].0))
                else {
                    break;
                };
                chosen.push(hosts[i].1[taken[i]].uuid.clone());
                taken[i] += 1;
            }
        }
    }
    chosen
}

/// What placement keeps from one decision to the next: per substrate, the index of its
/// inventory (kept while its driver reports the same inventory) and its free GPUs per host as
/// of the holdings the last decision read (brought up to date from the changes to the holdings
/// since, see [`HeldGpus`]), so that placing a lease does not recount the fleet. The caller owns
/// it and passes it to every evaluation; what it keeps changes how fast a decision is made,
/// never what is decided.
#[derive(Debug, Default)]
pub struct Placements {
    substrates: BTreeMap<String, Kept>,
}

#[derive(Debug)]
struct Kept {
    index: Arc<FleetIndex>,
    free: Option<FreeState>,
}

impl Placements {
    /// The index kept for `substrate`, if it was built from `inventory`.
    pub fn index_of(&self, substrate: &str, inventory: &Arc<Inventory>) -> Option<Arc<FleetIndex>> {
        self.substrates
            .get(substrate)
            .filter(|kept| kept.index.is_of(inventory))
            .map(|kept| kept.index.clone())
    }

    /// Keeps `index` for `substrate`, dropping what was kept for an older one.
    pub fn keep_index(&mut self, substrate: &str, index: Arc<FleetIndex>) {
        self.substrates
            .insert(substrate.to_owned(), Kept { index, free: None });
    }

    /// The free counts kept for `substrate` on `index`: none yet when the kept ones are of
    /// another index (which `index` then replaces).
    pub(super) fn free_of(
        &mut self,
        substrate: &str,
        index: &Arc<FleetIndex>,
    ) -> &mut Option<FreeState> {
        let kept = self
            .substrates
            .entry(substrate.to_owned())
            .or_insert_with(|| Kept {
                index: index.clone(),
                free: None,
            });
        if !Arc::ptr_eq(&kept.index, index) {
            *kept = Kept {
                index: index.clone(),
                free: None,
            };
        }
        &mut kept.free
    }
}
