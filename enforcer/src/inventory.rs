//! What a substrate has and whom it refuses, as its driver reports them: the GPUs it names or
//! pools ([`Inventory`], [`Gpu`]) and a refusal of a user whatever is free ([`Refusal`]). Plain
//! data below the policy, which decides from it, and the drivers, which report it (they name it
//! as `drivers::Inventory` too).

/// One GPU a substrate can hand out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// NVML UUID.
    pub uuid: String,
    /// Host it is on.
    pub host: String,
    /// Index on its host (what `CUDA_VISIBLE_DEVICES` names).
    pub index: u32,
    /// Full NVML model name.
    pub model: String,
}

impl From<gpuwarden_schema::fleet::InventoryGpu> for Gpu {
    /// A GPU of a simulated fleet, as the simulated driver reports it.
    fn from(g: gpuwarden_schema::fleet::InventoryGpu) -> Self {
        Self {
            uuid: g.uuid,
            host: g.host,
            index: g.index,
            model: g.model,
        }
    }
}

/// What a substrate has: GPUs it names, or a count of GPUs of a model it hands out itself.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Inventory {
    /// GPUs by UUID, when the substrate names them (simulated, local).
    pub gpus: Vec<Gpu>,
    /// Anonymous capacity `(model, count)` for substrates that pick devices themselves (webhook).
    pub pooled: Vec<(String, u32)>,
    /// The substrate queues what it cannot start now (Slurm): a request fits when its pooled
    /// capacity of the model is large enough in all, however much open leases hold of it.
    pub queues: bool,
}

/// Why a substrate will not take a lease for a user at all, whatever GPUs are free: admission
/// denies it with this code before placing anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What kind of refusal.
    pub code: RefusalCode,
    /// For a person: the user, the account and the setting behind it.
    pub message: String,
}

/// The kinds of [`Refusal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalCode {
    /// The user has no system account this substrate can run commands as.
    AccountUnmapped,
    /// The user's account is root, in root's group, or under the substrate's `min_uid`.
    AccountPrivileged,
}
